"""Walk the restore path of a real job: which baft modules rank 0's restore passes through.

Wraps a training script (run as ``__main__``); in a restarted attempt (torchrun's restart
count > 0, or an in-process generation > 0) rank 0 traces its main thread through
``recover_and_start`` with ``sys.setprofile`` and writes the walk as JSON:

- a *stay* is a maximal run of calls and returns inside one module of ``baft/`` (frames
  of other packages, torch or numpy, do not end a stay);
- *rooms* are the distinct modules; *returns* are stays in a room seen before
  (stays - rooms): how often the path shuttles back.

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 BAFT_WALK_OUT=walk.json torchrun --standalone \\
        --nproc-per-node 2 --max-restarts 1 tools/restore_walk.py examples/own_training.py \\
        --out runs/walk --iterations 6 --inject kill:rank=1,iter=4

A measurement tool, not part of the library (``print`` is fine here).
"""

from __future__ import annotations

import collections
import json
import os
import runpy
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import baft  # where baft is imported from (PYTHONPATH may name another checkout)

BAFT = str(Path(baft.__file__).resolve().parent) + os.sep


def _module(frame: FrameType | None) -> str | None:
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(BAFT):
            return path[len(BAFT) :].removesuffix(".py")
        frame = frame.f_back
    return None


def summarize(rooms_in_order: list[str]) -> dict[str, Any]:
    stays: list[str] = []
    for room in rooms_in_order:
        if not stays or stays[-1] != room:
            stays.append(room)
    visits = collections.Counter(stays)
    by_package = collections.Counter(s.split("/")[0] for s in stays)
    return {
        "stays": len(stays),
        "rooms": len(visits),
        "returns": len(stays) - len(visits),
        "visits": dict(visits.most_common()),
        "stays_by_package": dict(by_package.most_common()),
        "walk": stays,
    }


def traced(fn: Any) -> Any:
    def run(*args: Any, **kwargs: Any) -> Any:
        seen: list[str] = []
        me = threading.get_ident()

        def profile(frame: FrameType, event: str, arg: Any) -> None:
            if threading.get_ident() != me or event not in ("call", "return"):
                return
            room = _module(frame if event == "call" else frame.f_back)
            if room is not None:
                seen.append(room)

        sys.setprofile(profile)
        try:
            return fn(*args, **kwargs)
        finally:
            sys.setprofile(None)
            out = os.environ.get("BAFT_WALK_OUT", "restore-walk.json")
            Path(out).write_text(json.dumps(summarize(seen), indent=1))
            print(f"restore walk of rank 0: {out}", flush=True)

    return run


def main() -> None:
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    if restarted and os.environ.get("RANK", "0") == "0":
        import baft.recover.runtime as runtime

        runtime.recover_and_start = traced(runtime.recover_and_start)
    script, *args = sys.argv[1:]
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
