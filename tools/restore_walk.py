"""Walk the restore path of a real job: which baft modules rank 0's restore passes through.

Wraps a training script (run as ``__main__``); in a restarted attempt (torchrun's restart
count > 0, or an in-process generation > 0) rank 0 traces its main thread through
``recover_and_start`` with ``sys.setprofile`` and writes the walk as JSON:

- a *stay* is a maximal run of calls and returns inside one module of ``baft/`` (frames
  of other packages, torch or numpy, do not end a stay);
- *rooms* are the distinct modules; *returns* are stays in a room seen before
  (stays - rooms): how often the path shuttles back;
- stays in ``store/`` are counted per phase of the restore (:data:`PHASES`); the engine's
  start after the restore (planning the rotation) is not part of the walk.

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


PHASES = {
    "_inventory_and_agree": "inventory",
    "_layout_change": "check",
    "_check_saved_layout": "check",
    "_check_identity": "check",
    "_rebuild_and_load": "rebuild_load",
    "reclaim_stores": "reclaim",
    "_fill_report": "report",
}
"""The functions recover/runtime.py calls to open a phase of the restore (DESIGN: agree, check,
rebuild and load, reclaim, report); the engine's start is left out of the walk."""


def summarize(steps: list[tuple[str, str]]) -> dict[str, Any]:
    """``steps``: (phase, room) per call or return event, in order."""
    stays: list[tuple[str, str]] = []
    for phase, room in steps:
        if not stays or stays[-1][1] != room:
            stays.append((phase, room))
    visits = collections.Counter(room for _, room in stays)
    by_package = collections.Counter(room.split("/")[0] for _, room in stays)
    store_by_phase = collections.Counter(p for p, room in stays if room.startswith("store/"))
    return {
        "stays": len(stays),
        "rooms": len(visits),
        "returns": len(stays) - len(visits),
        "visits": dict(visits.most_common()),
        "stays_by_package": dict(by_package.most_common()),
        "store_stays_by_phase": dict(store_by_phase),
        "walk": [f"{p}:{r}" for p, r in stays],
    }


def traced(fn: Any) -> Any:
    def run(engine: Any, *args: Any, **kwargs: Any) -> Any:
        steps: list[tuple[str, str]] = []
        me = threading.get_ident()
        phase = ["start"]
        paused = [False]

        def profile(frame: FrameType, event: str, arg: Any) -> None:
            if paused[0] or threading.get_ident() != me or event not in ("call", "return"):
                return
            if event == "call" and frame.f_code.co_name in PHASES:
                if _module(frame.f_back) == "recover/runtime":  # called by the runtime
                    phase[0] = PHASES[frame.f_code.co_name]
            room = _module(frame if event == "call" else frame.f_back)
            if room is not None:
                steps.append((phase[0], room))

        start = engine.start

        def start_untraced(*a: Any, **k: Any) -> Any:  # the engine's start is not the restore
            paused[0] = True
            try:
                return start(*a, **k)
            finally:
                paused[0] = False

        engine.start = start_untraced
        sys.setprofile(profile)
        try:
            return fn(engine, *args, **kwargs)
        finally:
            sys.setprofile(None)
            del engine.start
            out = os.environ.get("BAFT_WALK_OUT", "restore-walk.json")
            Path(out).write_text(json.dumps(summarize(steps), indent=1))
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
