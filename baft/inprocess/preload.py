"""The forkserver a rank's training processes are forked from, and what it imports.

It is started first, before the supervisor imports torch for its control store
(:func:`start_forkserver`, from ``python -m baft.inprocess``): the forkserver's imports
(torch, baft, the script's own with ``BAFT_INPROCESS_PRELOAD``) then run beside the
supervisor's instead of after them, which shortens every launch and group restart
under in-process recovery by about one torch import (measured in ``docs/elastic-launch.md``:
workers started 7.9 s after a rendezvous under ``-m baft.inprocess``, 2.25 s without).
This module imports neither torch nor anything that does.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from multiprocessing import forkserver
from typing import Any

PRELOAD = [
    "torch", "torch.distributed", "torch.distributed.pipelining", "torch.distributed.fsdp",
    "torch.distributed.tensor.parallel", "torch.distributed.checkpoint", "baft.api",
    # what protect() and restore() import when first called: 0.66 s of a replacement's
    # start here before they were preloaded (py-spy of the replacement, baft train)
    "baft.engine.build", "baft.recover.runtime", "baft.recover.report", "baft.faults.injector",
    "baft.store.coding",
]  # fmt: skip
"""What the forkserver imports once for every training process it forks; add your own
heavy imports with ``BAFT_INPROCESS_PRELOAD=pkg.a,pkg.b`` (modules, imported, not run)."""


def forkserver_context() -> Any:
    """The forkserver context (``ForkServerContext``) with :data:`PRELOAD` and
    ``BAFT_INPROCESS_PRELOAD`` set."""
    ctx = multiprocessing.get_context("forkserver")
    extra = [m for m in os.environ.get("BAFT_INPROCESS_PRELOAD", "").split(",") if m]
    ctx.set_forkserver_preload(PRELOAD + extra)
    return ctx


def start_forkserver() -> None:
    """Start the forkserver now, with SIGTERM ignored (torchrun stops a worker with
    killpg(SIGTERM): a preemption must reach the training process, which flushes, not
    kill the process it is forked from); its imports run while the caller goes on."""
    forkserver_context()
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        forkserver.ensure_running()
    finally:
        signal.signal(signal.SIGTERM, previous)
