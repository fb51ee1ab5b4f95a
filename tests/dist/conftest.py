"""Launch helpers for distributed tests: run N gloo ranks as real processes.

Use the session fixture ``gloo``::

    def _worker(rank: int, world_size: int, root: str) -> dict:  # module level
        ...                       # default gloo group is already initialized
        return {"rank": rank}     # anything picklable with builtins only

    def test_x(gloo, tmp_path):
        values = gloo.run(_worker, 2, args=(str(tmp_path),), timeout_s=30)

Each rank is a fresh ``python -c`` process (``subprocess``) that loads the target's
source file by path (so no package layout is assumed), sets one torch thread, arms
``faulthandler.dump_traceback_later``, joins a gloo default group through a TCPStore
hosted by the test process on a free port, calls ``target(rank, world_size, *args)``
and pickles the return value. ``args`` must be picklable with builtins (str, int,
Path, ...). ``gloo.start`` returns a :class:`GlooJob` for tests that kill ranks.
"""

from __future__ import annotations

import inspect
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

REPO_ROOT = Path(__file__).resolve().parents[2]

_BOOTSTRAP = r"""
import faulthandler, importlib.util, os, pickle, sys
from datetime import timedelta
spec_path, rank = sys.argv[1], int(sys.argv[2])
with open(spec_path, "rb") as f:
    spec = pickle.load(f)
faulthandler.enable()
faulthandler.dump_traceback_later(spec["timeout_s"], exit=True)
import torch
torch.set_num_threads(1)
import torch.distributed as dist
store = dist.TCPStore(spec["host"], spec["port"], is_master=False,
                      timeout=timedelta(seconds=spec["timeout_s"]))
dist.init_process_group("gloo", store=store, rank=rank, world_size=spec["world_size"],
                        timeout=timedelta(seconds=spec["pg_timeout_s"]))
mod_spec = importlib.util.spec_from_file_location(spec["module"], spec["file"])
mod = importlib.util.module_from_spec(mod_spec)
sys.modules[spec["module"]] = mod
mod_spec.loader.exec_module(mod)
value = getattr(mod, spec["function"])(rank, spec["world_size"], *spec["args"])
out = os.path.join(spec["workdir"], f"result{rank}.pkl")
with open(out + ".tmp", "wb") as f:
    pickle.dump(value, f)
os.replace(out + ".tmp", out)
sys.stdout.flush()
dist.destroy_process_group()
# The result is written and every group destroyed: skip interpreter teardown. A gloo worker
# thread of a group the target made itself (init_device_mesh, fully_shard,
# distribute_tensor) may still drop its last collective's tensors while the interpreter
# exits, which aborts the process ("terminate called without an active exception",
# pytorch#179291; seen once in test_sharded_dp after its target returned). baft's own
# groups are destroyed by ft.close(), which test_shorthand_and_loop pins.
sys.stderr.flush()
os._exit(0)
"""


@dataclass(kw_only=True, slots=True)
class RankOutcome:
    """How one rank process ended."""

    rank: int
    """Rank in the job."""
    returncode: int
    """Process exit status (negative: killed by that signal)."""
    has_value: bool
    """Whether the target returned (its value was written back)."""
    value: Any
    """The target's return value (None when it did not return)."""
    log: str
    """Combined stdout and stderr of the process."""


class GlooJob:
    """A running group of rank processes; see :meth:`GlooLauncher.start`."""

    def __init__(self, procs: list[subprocess.Popen[bytes]], workdir: Path, store: Any) -> None:
        self.procs = procs
        """One process per rank, index = rank."""
        self.workdir = workdir
        """Spec, results and logs of this job."""
        self._store = store  # keeps the rendezvous TCPStore alive

    def kill(self, rank: int) -> None:
        """SIGKILL one rank (no-op if it already ended)."""
        if self.procs[rank].poll() is None:
            self.procs[rank].send_signal(signal.SIGKILL)

    def wait(self, timeout_s: float, *, grace_s: float = 10.0) -> list[RankOutcome]:
        """Wait for every rank; once one fails, give the rest ``grace_s`` then kill
        them. Past ``timeout_s`` all are killed. Never raises on rank failure."""
        deadline = time.monotonic() + timeout_s
        failed_at: float | None = None
        while any(p.poll() is None for p in self.procs):
            now = time.monotonic()
            if failed_at is None and any(p.poll() for p in self.procs):
                failed_at = now
            if now > deadline or (failed_at is not None and now > failed_at + grace_s):
                for rank in range(len(self.procs)):
                    self.kill(rank)
            time.sleep(0.02)
        return [self._outcome(rank) for rank in range(len(self.procs))]

    def _outcome(self, rank: int) -> RankOutcome:
        result = self.workdir / f"result{rank}.pkl"
        has_value = result.is_file()
        value = pickle.loads(result.read_bytes()) if has_value else None
        log = (self.workdir / f"rank{rank}.log").read_text(errors="replace")
        return RankOutcome(
            rank=rank,
            returncode=int(self.procs[rank].returncode),
            has_value=has_value,
            value=value,
            log=log,
        )


class GlooLauncher:
    """Starts gloo jobs whose files live under one base directory."""

    def __init__(self, base: Path) -> None:
        self.base = base

    def start(
        self,
        target: Callable[..., Any],
        num_ranks: int,
        *,
        args: tuple[Any, ...] = (),
        timeout_s: float = 60.0,
        pg_timeout_s: float = 30.0,
    ) -> GlooJob:
        """Start ``num_ranks`` processes running ``target(rank, num_ranks, *args)``.

        ``target`` must be a module-level function. ``timeout_s`` arms faulthandler
        in each child (dump stacks and exit); ``pg_timeout_s`` is the default
        group's timeout.
        """
        source = inspect.getsourcefile(target)
        assert source is not None, f"cannot find the source file of {target}"
        workdir = Path(tempfile.mkdtemp(prefix="gloo-", dir=self.base))
        store = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False,
            timeout=timedelta(seconds=timeout_s),
        )  # fmt: skip
        spec = {
            "host": "127.0.0.1",
            "port": store.port,
            "world_size": num_ranks,
            "timeout_s": timeout_s,
            "pg_timeout_s": pg_timeout_s,
            "module": f"_gloo_target_{Path(source).stem}",
            "file": source,
            "function": target.__name__,
            "args": args,
            "workdir": str(workdir),
        }
        spec_path = workdir / "spec.pkl"
        spec_path.write_bytes(pickle.dumps(spec))
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join(
            [str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])]
        )
        procs = []
        for rank in range(num_ranks):
            with open(workdir / f"rank{rank}.log", "wb") as log:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-c", _BOOTSTRAP, str(spec_path), str(rank)],
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env=env,
                        cwd=REPO_ROOT,
                    )  # fmt: skip
                )
        return GlooJob(procs, workdir, store)

    def run(
        self,
        target: Callable[..., Any],
        num_ranks: int,
        *,
        args: tuple[Any, ...] = (),
        timeout_s: float = 60.0,
        pg_timeout_s: float = 30.0,
    ) -> list[Any]:
        """Run a job to the end; return each rank's value or fail with the logs."""
        job = self.start(
            target, num_ranks, args=args, timeout_s=timeout_s, pg_timeout_s=pg_timeout_s
        )
        outcomes = job.wait(timeout_s + 5.0)
        bad = [o for o in outcomes if o.returncode != 0 or not o.has_value]
        if bad:
            logs = "\n".join(
                f"--- rank {o.rank} exit {o.returncode}, "
                f"{'after' if o.has_value else 'before'} its target returned ---\n{o.log[-6000:]}"
                for o in bad
            )
            pytest.fail(f"gloo job {target.__name__} failed:\n{logs}", pytrace=False)
        return [o.value for o in outcomes]


@pytest.fixture(scope="session")
def gloo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GlooLauncher]:
    """Launcher for real multi-process gloo jobs (see the module docstring)."""
    yield GlooLauncher(tmp_path_factory.mktemp("gloo"))
