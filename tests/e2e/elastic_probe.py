"""A tiny elastic job for measuring how torchrun shrinks and grows a job (issue 39).

Each rank initialises gloo and loops: one all-reduce of ``[1, stop]`` (the world's size and
whether any rank saw ``OUT/STOP``), a sleep, and one JSON line appended to
``OUT/<host>-<local rank>.jsonl`` per iteration::

    {"event": "iter", "t": wall time, "restart_count": TORCHELASTIC_RESTART_COUNT,
     "world": WORLD_SIZE, "rank": RANK, "host": BAFT_HOST_ID, "iter": i, "pid": ...}

plus an ``"event": "start"`` line per entry (``t_proc``: the process's first line,
``t_import``: torch imported, ``t``: the process group is up) and ``"event": "failed"``
when the all-reduce raised (a peer is gone: ``t`` is when this rank noticed). Every rank
stops after the iteration in which any rank saw ``OUT/STOP``, so all stop together.

Plain (one process per rank)::

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 BAFT_HOST_ID=a torchrun --nnodes 1:2 \\
        --nproc-per-node 2 --rdzv-backend c10d ... tests/e2e/elastic_probe.py --out DIR

Under baft's in-process supervisor (``--inprocess``: the loop is ``main()`` run through
``baft.run(main)``; launch with ``torchrun ... -m baft.inprocess tests/e2e/elastic_probe.py
--out DIR --inprocess``). Every iteration then reports progress to the supervisor as a
protected job's engine does. torchrun stops the workers with SIGTERM to grow the job:
``--sigterm exit`` (the default) leaves at once, as an engine that took the SIGTERM and
had nothing to flush; ``--sigterm hold`` keeps ``baft.run``'s SIGTERM hold (no engine ever
takes it: the process leaves after ``BAFT_INPROCESS_HOLD_SIGTERM_S``). See
:mod:`tests.e2e.elastic_launch` and ``docs/elastic-launch.md``.
"""

from __future__ import annotations

import time

T_PROC = time.time()  # before any import: when this process started running Python

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--sleep", type=float, default=0.1, help="seconds between iterations")
    p.add_argument("--timeout", type=float, default=60.0, help="gloo timeout, seconds")
    p.add_argument("--inprocess", action="store_true", help="run main() through baft.run")
    p.add_argument("--sigterm", choices=["exit", "hold"], default="exit")
    return p.parse_args(argv)


class Log:
    """One rank's JSON lines (one ``write`` on an O_APPEND fd each)."""

    def __init__(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        host = os.environ.get("BAFT_HOST_ID", "-")
        path = out / f"{host}-{os.environ.get('LOCAL_RANK', '0')}.jsonl"
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.base = {
            "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            "host": host,
            "pid": os.getpid(),
        }

    def write(self, event: str, **fields: Any) -> None:
        rec = {"event": event, "t": time.time(), **self.base, **fields}
        rec["gen"] = int(os.environ.get("BAFT_GENERATION", "0"))
        os.write(self.fd, (json.dumps(rec) + "\n").encode())


def main(args: argparse.Namespace, t_import: float) -> None:
    import torch
    import torch.distributed as dist

    log = Log(args.out)
    link = None
    if args.inprocess:
        from baft.liveness import generation

        link = generation.current()
        if args.sigterm == "exit":  # a flush with nothing to write: leave at once
            signal.signal(signal.SIGTERM, lambda *_: os._exit(143))
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    log.write(
        "start", rank=rank, world=world, t_proc=T_PROC, t_import=t_import,
        group_rank=int(os.environ.get("GROUP_RANK", "-1")),
    )  # fmt: skip
    stop = args.out / "STOP"
    i = 0
    while True:
        buf = torch.tensor([1.0, 1.0 if stop.exists() else 0.0])
        try:
            dist.all_reduce(buf)
        except Exception as e:
            log.write("failed", rank=rank, world=world, iter=i, error=str(e)[:300])
            raise
        log.write("iter", rank=rank, world=world, iter=i, sum=buf[0].item())
        if link is not None:
            link.progress()
        if buf[1].item() > 0:
            break
        i += 1
        time.sleep(args.sleep)
    dist.destroy_process_group()


if __name__ == "__main__":
    ns = _args()
    import torch  # noqa: F401  (timed: the import is part of a worker's start)

    t_imp = time.time()
    if ns.inprocess:
        import baft

        baft.run(main, ns, t_imp)
    else:
        main(ns, t_imp)
