"""DataLoader worker processes live through a preemption's SIGTERM until the flush is done.

torchrun stops a worker with ``killpg(SIGTERM)``, which reaches every process the
training process forked. torch's DataLoader workers install a C-level SIGTERM handler
(``_set_worker_signal_handlers``: leave at once) and die of it; the training process then
raises ``DataLoader worker ... exited unexpectedly`` at its next batch, before the
SIGTERM flush's agreed vote, and the preemption loses every iteration since the last
DCP checkpoint. With baft's SIGTERM flush active, workers forked from then on keep
torch's rule for a SIGTERM their parent sends (``multiprocessing``'s exit terminates its
daemonic children with one: the worker leaves at once) and ignore any other (the
preemption's, which their parent got too: it flushes, then shuts them down as on any
clean end). A worker tells the two apart by the sender's pid (``sigwaitinfo`` on a
thread, SIGTERM blocked in the worker); it still leaves with its parent (torch's
``ManagerWatchdog``) and dies of SIGKILL.

This is the one place baft touches DataLoader internals (a private torch module: no
public hook runs in the worker after torch's own handlers but the user's
``worker_init_fn``). Workers started with the spawn or forkserver context import torch
afresh and keep torch's handler.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any


def keep_loader_workers_through_sigterm() -> None:
    """From now on, DataLoader workers this process forks ignore SIGTERM. Idempotent: the
    patched function marks itself (torch's module is the one state, no flag of ours)."""
    if "torch" not in sys.modules:  # no torch, no DataLoader workers (baft's callers run
        return  # with torch imported; a process without it need not pay its import here)
    try:
        from torch.utils.data._utils import signal_handling
    except ImportError:  # another torch: its workers die of the SIGTERM as without baft
        return
    original = signal_handling._set_worker_signal_handlers
    if getattr(original, "_baft", False):
        return

    def set_worker_signal_handlers(*args: Any) -> None:
        original(*args)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # threads inherit it
        threading.Thread(target=_obey_parent_only, name="baft-sigterm", daemon=True).start()

    set_worker_signal_handlers._baft = True  # type: ignore[attr-defined]
    signal_handling._set_worker_signal_handlers = set_worker_signal_handlers


def _obey_parent_only() -> None:
    """In a DataLoader worker: leave on a SIGTERM from the parent (as torch's handler
    does) or once the parent is gone; ignore one from anyone else."""
    parent = os.getppid()
    while True:
        info = signal.sigwaitinfo({signal.SIGTERM})
        if info.si_pid == parent or os.getppid() != parent:
            os._exit(0)
