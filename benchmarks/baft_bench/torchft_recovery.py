"""torchft 0.2.0 after a rank crash, for ``baft bench recovery``.

torchft's own deployment (its README and ``train_ddp.py``): the ``torchft_lighthouse``
binary of the wheel, started by the bench with the README's ``--min_replicas 1
--quorum_tick_ms 100 --join_timeout_ms 10000`` (``--heartbeat_timeout_ms``: its default,
5000), and one ``torchrun --nproc-per-node=1 --max-restarts=N`` per replica group; each
worker is a ``Manager(pg=ProcessGroupGloo(), min_replica_size=1,
checkpoint_transport=PGTransport(...))`` with ``Optimizer(manager, AdamW)`` on the job of
:mod:`baft_bench.dp_job` (two replica groups of one rank, the whole GPT each). A step's
data is a function of the committed step (``manager.current_step()``), so a step that
does not commit is tried again on the same batch.

Gradients are averaged one of two ways (``grad_sync``):

- ``ddp``: torchft's ``DistributedDataParallel(manager, model)``, as ``train_ddp.py``;
- ``manager``: ``Manager.allreduce`` on one flat buffer of the gradients, then ``wait()``
  (what the DDP wrapper's comm hook calls per bucket). On gloo the wrapper cannot survive
  a peer's crash: when a bucket's allreduce fails, ``_ManagedWork.wait()`` reports the
  error to the manager and returns False before it has built its future chain, and the
  hook's ``assert fut._fut`` (torchft/ddp.py) fails; buckets after the error get a
  ``_DummyWork`` whose plain future has no ``_fut``. The survivor's worker dies, so both
  replica groups restart with no live replica to heal from.

The bench SIGKILLs one replica group's worker from outside (replica 1, then 0, ...) at a
random moment once the job has trained ``gap`` steps at full strength; that replica's
torchrun starts a new worker, which joins the lighthouse's next quorum and heals from the
live replica (the peer's model and optimizer state dict over ``PGTransport``). Survivors
do not stop: their step in flight fails and is not committed, and they commit alone once
the lighthouse has a new quorum, which waits for the dead replica's heartbeat to time out
(no quorum with half of the heartbeating replicas or fewer). A failure-free job of the
same length gives the final state the faulted job's is compared with.

With ``min_replicas=2`` (``Manager(min_replica_size=2)``) a survivor alone does not
commit (``should_commit`` needs that many participants): it tries the same step again
until the new worker has healed, so no replica's rows are dropped and the job stands
still instead.

Worker: ``python -m baft_bench.torchft_recovery CONFIG_JSON`` under torchrun.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from baft_bench.peer_jobs import (
    ATTEMPTS,
    FINAL,
    FINAL_MODEL,
    READY,
    emit,
    end_all,
    free_port,
    kill_from_outside,
    records,
    stop_at,
)

LIGHTHOUSE = {"min_replicas": 1, "quorum_tick_ms": 100, "join_timeout_ms": 10000}
"""The lighthouse of torchft's README (``heartbeat_timeout_ms``: its default, 5000)."""


def _worker(c: dict[str, Any], t_start: float) -> None:
    from datetime import timedelta

    import torch
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo
    from torchft.checkpointing.pg_transport import PGTransport

    from baft_bench.dp_job import (
        DPJob,
        forward_backward,
        load_state_dict,
        replica_batch,
        state_dict,
        state_digest,
    )

    out = Path(c["out"])
    replica = int(os.environ["REPLICA_GROUP_ID"])
    torch.set_num_threads(1)
    job = DPJob(layers=c["layers"], d_model=c["d_model"])
    module, opt = job.build()
    data = job.data()
    restored: list[float] = []

    class TimedTransport(PGTransport):  # type: ignore[misc]
        """torchft's PGTransport, timing the state transfer of a heal."""

        def recv_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
            t = time.time()
            sd = super().recv_checkpoint(*args, **kwargs)
            restored.append(time.time() - t)
            return sd

    timeout = timedelta(seconds=c["timeout_s"])
    pg = ProcessGroupGloo(timeout=timeout)
    manager = Manager(
        pg=pg,
        min_replica_size=c["min_replicas"],
        load_state_dict=lambda sd: load_state_dict(module, opt, sd),
        state_dict=lambda: state_dict(module, opt),
        replica_id=f"baft_bench_{replica}",
        timeout=timeout,
        checkpoint_transport=TimedTransport(pg, timeout=timeout, device=torch.device("cpu")),
        lighthouse_addr=c["lighthouse"],
    )
    params = list(module.parameters())
    model = DistributedDataParallel(manager, module) if c["grad_sync"] == "ddp" else module
    optim = Optimizer(manager, opt)
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0:
        _start_barrier(out, replica)
    ready: dict[str, Any] | None = {"pid": os.getpid(), "replica": replica, "t_start": t_start, "t_ready": time.time()}  # fmt: skip
    while manager.current_step() < stop_at(out, c["steps"]):
        step = manager.current_step()
        t0 = time.time()
        optim.zero_grad()  # torchft: starts the quorum
        forward_backward(model, *replica_batch(data, step, replica))
        if c["grad_sync"] == "manager":
            _allreduce_grads(manager, params)
        manager.wait_quorum()  # done by now: a heal has set the step it healed to
        step = manager.current_step()
        optim.step()  # torchft: should_commit, then the optimizer step if committed
        committed = manager.current_step() > step
        emit(out / ATTEMPTS, {
            "pid": os.getpid(), "replica": replica, "step": step,
            "t0": t0, "t1": time.time(), "committed": committed,
            "participants": manager.num_participants(), "participating": manager.is_participating(),
        })  # fmt: skip
        if ready is not None:  # after the first attempt: its heal (if any) is done
            emit(out / READY, {**ready, "restore_s": sum(restored) if restored else None})
            ready = None
    final = {
        "replica": replica,
        "step": manager.current_step(),
        "digest": state_digest(module, opt),
    }
    (out / FINAL.format(replica=replica)).write_text(json.dumps(final) + "\n")
    if replica == 0:
        torch.save(
            {k: v.detach().clone() for k, v in module.state_dict().items()}, out / FINAL_MODEL
        )
    manager.shutdown(wait=False)


def _allreduce_grads(manager: Any, params: list[Any]) -> None:
    """The gradients' mean over the participating replicas through ``Manager.allreduce``
    (one flat buffer). On an error it reports to the manager and returns (the Manager's
    contract), so ``should_commit`` says no."""
    import torch

    flat = torch.cat([p.grad.reshape(-1) for p in params])
    manager.allreduce(flat).wait()
    off = 0
    for p in params:
        n = p.grad.numel()
        p.grad.copy_(flat[off : off + n].view_as(p.grad))
        off += n


def _start_barrier(out: Path, replica: int) -> None:
    """The first launch's replicas start training together: both managers heartbeat to
    the lighthouse before either asks for a quorum, so the first quorum has both.
    Otherwise the first replica up trains alone and the other heals from it when it
    comes, and a failure-free job's trajectory would depend on start-up times."""
    (out / f"up-r{replica}").touch()
    while not all((out / f"up-r{r}").exists() for r in range(2)):
        time.sleep(0.05)
    time.sleep(0.5)  # several of the managers' heartbeats (every 100 ms)


def _env(replica: int, lighthouse: str) -> dict[str, str]:
    from baft.train.launch import launch_env

    env = launch_env()
    # torchft's Manager connects to torchrun's store (MASTER_ADDR/PORT, is_master=False):
    # the agent must share its rendezvous store with the workers (torchrun's default)
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    env.update({"REPLICA_GROUP_ID": str(replica), "TORCHFT_LIGHTHOUSE": lighthouse})
    env.setdefault("RUST_LOG", "error")
    return env


def run_job(
    out: Path, *, layers: int, d_model: int, steps: int, kills: int, gap: int, seed: int,
    grad_sync: str = "manager", min_replicas: int = 1, timeout_s: float = 60.0,
    deadline_s: float = 1800.0,
) -> dict[str, Any]:  # fmt: skip
    """One torchft job (its lighthouse, two torchruns) with ``kills`` SIGKILLs from
    outside; returns the kills, the workers' records and both replicas' final digests.
    Each process's output goes to a log in ``out``."""
    import shutil

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    port = free_port()
    address = f"http://127.0.0.1:{port}"
    lh = [str(Path(sys.executable).parent / "torchft_lighthouse"), "--bind", f"127.0.0.1:{port}"]
    lh += [f"--{k}={v}" for k, v in LIGHTHOUSE.items()]
    config = {
        "out": str(out), "layers": layers, "d_model": d_model, "steps": steps,
        "timeout_s": timeout_s, "lighthouse": address, "grad_sync": grad_sync, "min_replicas": min_replicas,
    }  # fmt: skip
    path = out / "torchft-recovery.json"
    path.write_text(json.dumps(config) + "\n")
    with (out / "lighthouse.log").open("w") as log:
        procs = [subprocess.Popen(lh, stdout=log, stderr=log, start_new_session=True)]
    try:
        for r in range(2):
            cmd = [
                sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node=1", f"--max-restarts={kills}", "--monitor-interval=0.1",
                "-m", "baft_bench.torchft_recovery", str(path),
            ]  # fmt: skip
            with (out / f"torchrun-r{r}.log").open("w") as log:
                procs.append(subprocess.Popen(cmd, env=_env(r, address), stdout=log, stderr=log, start_new_session=True))  # fmt: skip
        deadline = time.time() + deadline_s
        done, end = kill_from_outside(out, kills, gap, seed, deadline, target=lambda i: (i + 1) % 2)
        rcs = [p.wait(timeout=max(1.0, deadline - time.time())) for p in procs[1:]]
    finally:
        end_all(procs)
    if any(rcs) or len(done) != kills or (kills and end is None):
        raise RuntimeError(f"the torchft job in {out} failed (exit codes {rcs}, {len(done)} of {kills} kills); see its logs")  # fmt: skip
    return {"kills": done, "steps": steps if end is None else end, **records(out)}


def main(argv: list[str] | None = None) -> int:
    import faulthandler

    import torchft  # noqa: F401  (imports before the clock starts, as baft's worker)

    t_start = time.time()
    faulthandler.enable()
    argv = sys.argv[1:] if argv is None else argv
    _worker(json.loads(Path(argv[0]).read_text()), t_start)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # torchft's Rust threads and gloo: no interpreter finalization


if __name__ == "__main__":
    sys.exit(main())
