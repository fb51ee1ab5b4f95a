"""NVRx 0.4.1's in-process restart (``nvidia_resiliency_ext.inprocess.Wrapper``) after a
rank crash, for ``baft bench recovery``.

The configuration in which it runs on CPU/gloo (benchmarks/results/nvrx-inprocess-eval-
2026-12-06.md): processes started by the bench, not torchrun (torchrun's agent stops every
worker when one exits, so the in-process restart never runs; NVRx says it is "not fully
compatible with torch.distributed.run"); no health check (``CudaHealthCheck`` does
nothing without CUDA); NVRx's default abort (``AbortTorchDistributed``). NVRx does not
replace a dead rank: its rank assignment shifts the survivors down. To keep the job's two
DP replicas, the bench starts ``2 + kills`` processes and the wrapper activates two
(``Compose(MaxActiveWorldSize(2), ShiftRanks())``): after a crash a reserve becomes rank 1.

NVRx keeps no training state; its usage guide has the restarted function reload it. Here
the model and optimizer live outside the wrapped function, so survivors keep theirs, and
on every restart the function broadcasts the state of the rank with the most steps to
the others (one flat buffer over gloo): what a user of NVRx writes, reported as the
``restore`` phase. The job is :mod:`baft_bench.dp_job`'s (the whole GPT on each of two
replicas, gradients averaged with one all_reduce); the optimizer step runs inside
``CallWrapper.atomic()`` so that a restart cannot cut it in half.

The bench SIGKILLs active rank 1's process from outside at a random moment once the job
has trained ``gap`` steps; rank 0 is never killed: it hosts NVRx's own TCPStore
(``inprocess.store.TCPStore.TCP_STORE_HOST_RANK = 0``, its ``critical_ranks``) and the
job's, and the wrapper cannot go on without them. Wrapper timings are those of the
evaluation page (monitor and heartbeat intervals 0.5 s, last_call_wait 0.5 s) with longer
progress timeouts for this loaded box (soft 15 s, hard 20 s).

Worker: ``python -m baft_bench.nvrx_recovery CONFIG_JSON`` with ``RANK``/``WORLD_SIZE``/
``MASTER_ADDR``/``MASTER_PORT`` set by the bench.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import timedelta
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

ACTIVE = 2
WRAPPER_S = {
    "monitor_thread_interval": 0.5, "monitor_process_interval": 0.5,
    "progress_watchdog_interval": 0.5, "heartbeat_interval": 0.5, "heartbeat_timeout": 5.0,
    "soft_timeout": 15.0, "hard_timeout": 20.0, "barrier_timeout": 60.0,
    "completion_timeout": 60.0, "last_call_wait": 0.5,
}  # fmt: skip
"""The Wrapper's intervals and timeouts, in seconds."""


def init_optimizer_state(module: Any, opt: Any) -> None:
    """AdamW's state as its first step creates it (``step`` 0, zero moments), so that a
    reserve that never stepped has the same tensors to receive a broadcast into."""
    import torch

    for p in module.parameters():
        if not opt.state.get(p):
            opt.state[p] = {
                "step": torch.tensor(0.0, dtype=torch.float32),
                "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
            }


def _sync_state(module: Any, opt: Any, progress: dict[str, int]) -> float:
    """Collective: every rank takes the state of the lowest rank with the most steps."""
    import torch
    import torch.distributed as dist

    from baft_bench.dp_job import state_tensors

    t = time.time()
    world = dist.get_world_size()
    steps = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(steps, torch.tensor([progress["step"]], dtype=torch.int64))
    got = [int(s) for s in steps]
    src = got.index(max(got))
    tensors = [v for _, v in state_tensors(module, opt)]
    if any(v.dtype != torch.float32 for v in tensors):
        raise TypeError("the state broadcast expects float32 tensors only")
    flat = torch.cat([v.reshape(-1) for v in tensors])
    dist.broadcast(flat, src=src)
    with torch.no_grad():
        off = 0
        for v in tensors:
            v.copy_(flat[off : off + v.numel()].view_as(v))
            off += v.numel()
    progress["step"] = max(got)
    return time.time() - t


def _worker(c: dict[str, Any], t_proc: float) -> None:
    import nvidia_resiliency_ext.inprocess as inprocess
    import torch
    import torch.distributed as dist

    from baft_bench.dp_job import DPJob, forward_backward, replica_batch, state_digest

    out = Path(c["out"])
    torch.set_num_threads(1)
    job = DPJob(layers=c["layers"], d_model=c["d_model"])
    module, opt = job.build()
    init_optimizer_state(module, opt)
    data = job.data()
    params = list(module.parameters())
    progress = {"step": 0}  # optimizer steps this process's state has taken
    initial_rank = int(os.environ["RANK"])
    base_store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]) + 1,
        int(os.environ["WORLD_SIZE"]), is_master=initial_rank == 0,
        multi_tenant=True, wait_for_workers=True, use_libuv=True,
    )  # fmt: skip
    ra = inprocess.rank_assignment
    wrapper = inprocess.Wrapper(
        store_kwargs={"port": int(os.environ["MASTER_PORT"]) + 2},
        rank_assignment=inprocess.Compose(ra.MaxActiveWorldSize(ACTIVE), ra.ShiftRanks()),
        **{k: timedelta(seconds=v) for k, v in WRAPPER_S.items()},
    )

    def train(call_wrapper: inprocess.CallWrapper | None = None) -> None:
        assert call_wrapper is not None
        t_enter = time.time()
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = dist.PrefixStore(f"it{call_wrapper.iteration}", base_store)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=c["timeout_s"]))  # fmt: skip
        restore_s = _sync_state(module, opt, progress) if call_wrapper.iteration > 0 else None
        emit(out / READY, {"pid": os.getpid(), "replica": rank, "t_start": t_enter if call_wrapper.iteration else t_proc, "t_ready": time.time(), "restore_s": restore_s, "iteration": call_wrapper.iteration})  # fmt: skip
        while progress["step"] < stop_at(out, c["steps"]):
            call_wrapper.ping()
            step, t0 = progress["step"], time.time()
            rec = {"pid": os.getpid(), "replica": rank, "step": step, "t0": t0, "participants": world}  # fmt: skip
            try:
                opt.zero_grad()
                forward_backward(module, *replica_batch(data, step, rank))
                grads = [p.grad for p in params if p.grad is not None]
                assert len(grads) == len(params), "every parameter has a gradient"
                flat = torch.cat([g.reshape(-1) for g in grads])
                dist.all_reduce(flat)
                flat /= world
                with call_wrapper.atomic():  # no restart halfway through the update
                    off = 0
                    for g in grads:
                        g.copy_(flat[off : off + g.numel()].view_as(g))
                        off += g.numel()
                    opt.step()
                    progress["step"] += 1
            except BaseException:
                emit(out / ATTEMPTS, {**rec, "t1": time.time(), "committed": False})
                raise
            emit(out / ATTEMPTS, {**rec, "t1": time.time(), "committed": True})
        final = {"replica": rank, "step": progress["step"], "digest": state_digest(module, opt)}
        (out / FINAL.format(replica=rank)).write_text(json.dumps(final) + "\n")
        if rank == 0:
            torch.save(
                {k: v.detach().clone() for k, v in module.state_dict().items()}, out / FINAL_MODEL
            )

    # the Wrapper passes itself to the parameter annotated CallWrapper; annotations are
    # strings in this module (``from __future__ import annotations``)
    train.__annotations__["call_wrapper"] = inprocess.CallWrapper
    wrapper(train)()
    if dist.is_initialized():
        dist.destroy_process_group()


def run_job(
    out: Path, *, layers: int, d_model: int, steps: int, kills: int, gap: int, seed: int,
    timeout_s: float = 60.0, deadline_s: float = 1800.0,
) -> dict[str, Any]:  # fmt: skip
    """One NVRx job (``2 + kills`` processes) with ``kills`` SIGKILLs of active rank 1
    from outside; returns the kills, the workers' records and both replicas' final
    digests. Each process's output goes to a log in ``out``."""
    import shutil

    from baft.train.launch import launch_env

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    config = {"out": str(out), "layers": layers, "d_model": d_model, "steps": steps, "timeout_s": timeout_s}  # fmt: skip
    path = out / "nvrx-recovery.json"
    path.write_text(json.dumps(config) + "\n")
    world = ACTIVE + kills
    env = launch_env()
    env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(world)})  # fmt: skip
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for r in range(world):
            cmd = [sys.executable, "-m", "baft_bench.nvrx_recovery", str(path)]
            with (out / f"rank{r}.log").open("w") as log:
                procs.append(subprocess.Popen(cmd, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=log, stderr=log, start_new_session=True))  # fmt: skip
        deadline = time.time() + deadline_s
        done, end = kill_from_outside(out, kills, gap, seed, deadline, target=lambda i: 1)
        killed = {k["pid"] for k in done}
        rcs = {p.pid: p.wait(timeout=max(1.0, deadline - time.time())) for p in procs}
    finally:
        end_all(procs)
    bad = {pid: rc for pid, rc in rcs.items() if rc != 0 and pid not in killed}
    if bad or len(done) != kills or (kills and end is None):
        raise RuntimeError(f"the NVRx job in {out} failed (exit codes {bad}, {len(done)} of {kills} kills); see its logs")  # fmt: skip
    return {"kills": done, "steps": steps if end is None else end, **records(out)}


def main(argv: list[str] | None = None) -> int:
    import faulthandler

    import nvidia_resiliency_ext.inprocess  # noqa: F401  (imports before the clock starts)

    t_proc = time.time()
    faulthandler.enable()
    argv = sys.argv[1:] if argv is None else argv
    _worker(json.loads(Path(argv[0]).read_text()), t_proc)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo and NVRx's threads: no interpreter finalization


if __name__ == "__main__":
    sys.exit(main())
