"""The training process a supervisor starts: the user's script, run as ``__main__``.

Started from a forkserver that imported torch and baft once (:mod:`.supervisor`), so a
replacement process pays neither the interpreter's start nor torch's import. It sets
its environment for the generation it joins (``MASTER_PORT`` = that generation's store,
``TORCHELASTIC_USE_AGENT_STORE=True``: the supervisor hosts the store, so no rank's
``init_process_group`` tries to), installs its :class:`~baft.inprocess.channel.Channel`
and runs the script (``runpy``) exactly as ``python script.py args`` or
``python -m module args`` would.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import runpy
import signal
import sys
from dataclasses import dataclass
from typing import Any

from baft.inprocess.channel import Channel, enter_environment
from baft.liveness import generation as link
from baft.liveness.generation import Generation

_PR_SET_NAME = 15


NCCL_ENV = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",
    "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0",
    "NCCL_NVLS_ENABLE": "0",
}
"""What an in-process abort of NCCL groups needs, set for the training process unless the
user set it: torch's ``_abort_process_group`` asks for ``TORCH_NCCL_ASYNC_ERROR_HANDLING=0``
(otherwise ProcessGroupNCCL's watchdog tears the survivor's process down on the peer's
error, before baft aborts and re-enters); ``TORCH_NCCL_RETHROW_CUDA_ERRORS=0`` keeps the
watchdog from rethrowing NCCL errors (it would end the process); NVLink SHARP (NVLS)
cannot be aborted (NVRx's in-process restart documents the same three). A hang is still
bounded: baft's watchdog names a frozen rank and the generation's abort ends its waits."""


def nccl_env(environ: dict[str, str] | os._Environ[str]) -> tuple[dict[str, str], list[str]]:
    """``(to_set, conflicts)``: the :data:`NCCL_ENV` values ``environ`` lacks, and a line
    for each one the user set otherwise (left as set: in-process recovery of NCCL groups
    may then end a survivor). Pure."""
    to_set = {k: v for k, v in NCCL_ENV.items() if k not in environ}
    conflicts = [
        f"{k}={environ[k]} (in-process recovery needs {v})"
        for k, v in NCCL_ENV.items()
        if k in environ and environ[k] != v
    ]
    return to_set, conflicts


@dataclass(frozen=True)
class Target:
    """What to run: a script path, or a module (``-m``), and its arguments."""

    path: str
    module: bool
    args: tuple[str, ...]


def _prctl(option: int, arg: Any) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(option, arg, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the channel's EOF still ends us
        pass


def child_main(target: Target, conn: Any, generation: Generation) -> None:
    """Entry of a training process (in the forkserver's child)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the forkserver ignores it, not us
    # started from a forkserver, multiprocessing's default here would be "forkserver":
    # back to the platform's default, as under ``python script.py`` (DataLoader workers
    # are forked from the training process, not started from a fresh interpreter)
    multiprocessing.set_start_method(None, force=True)
    enter_environment(generation)  # a replacement in a shrunk job takes its new rank
    rank = int(os.environ.get("RANK", "0"))
    _prctl(_PR_SET_NAME, ctypes.c_char_p(f"baft-rank{rank}".encode()[:15]))
    to_set, conflicts = nccl_env(os.environ)
    os.environ.update(to_set)
    if conflicts and rank == 0:
        logging.getLogger("baft").warning(
            "baft: NCCL settings against in-process recovery: %s", "; ".join(conflicts)
        )
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    link.install(Channel(conn, generation, rank))
    sys.argv = [target.path, *target.args]
    if target.module:
        runpy.run_module(target.path, run_name="__main__", alter_sys=True)
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(target.path)))
        runpy.run_path(target.path, run_name="__main__")
