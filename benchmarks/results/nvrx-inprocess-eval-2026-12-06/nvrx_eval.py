"""2-rank gloo loop under nvidia_resiliency_ext.inprocess.Wrapper (NVRx 0.4.1), CPU only.
Launched by hand (env RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT), one rank is SIGKILLed or
SIGSTOPped from outside. Every line: monotonic time, rank, pid, event."""

import datetime
import os
import time

import nvidia_resiliency_ext.inprocess as inprocess
import torch
import torch.distributed as dist

PORT = int(os.environ["MASTER_PORT"])
STEPS = int(os.environ.get("STEPS", "40"))


def say(msg):
    print(f"{time.monotonic():.3f} rank{os.environ.get('RANK')} pid{os.getpid()} {msg}", flush=True)


base_store = dist.TCPStore(
    os.environ["MASTER_ADDR"],
    PORT + 1,
    int(os.environ["WORLD_SIZE"]),
    is_master=int(os.environ["RANK"]) == 0,
    multi_tenant=True,
    wait_for_workers=True,
    use_libuv=True,
)


@inprocess.Wrapper(
    store_kwargs={"port": PORT + 2},
    health_check=inprocess.health_check.CudaHealthCheck() if os.environ.get("CUDA_HC") else None,
    monitor_thread_interval=datetime.timedelta(seconds=0.5),
    monitor_process_interval=datetime.timedelta(seconds=0.5),
    heartbeat_interval=datetime.timedelta(seconds=0.5),
    heartbeat_timeout=datetime.timedelta(seconds=3),
    soft_timeout=datetime.timedelta(seconds=5),
    hard_timeout=datetime.timedelta(seconds=float(os.environ.get("HARD_S", "8"))),
    barrier_timeout=datetime.timedelta(seconds=float(os.environ.get("HARD_S", "8")) + 12),
    completion_timeout=datetime.timedelta(seconds=20),
    last_call_wait=datetime.timedelta(seconds=0.5),
)
def train(call_wrapper: inprocess.CallWrapper | None = None):
    it = call_wrapper.iteration
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    say(f"enter wrapped fn: restart iteration {it}, rank {rank} of {world}")
    store = dist.PrefixStore(f"it{it}", base_store)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )
    x = torch.ones(4)
    for step in range(STEPS):
        call_wrapper.ping()
        if it == 0 and step == int(os.environ.get("SLEEP_AT", "-1")) and rank == 1:
            say("sleeping 25 s in Python (no ping, no collective)")
            time.sleep(25)
        t = time.monotonic()
        try:
            dist.all_reduce(x)
        except BaseException as e:
            say(
                f"step {step} all_reduce raised after {time.monotonic() - t:.3f}s: {type(e).__name__}: {str(e)[:90]}"
            )
            raise
        say(f"step {step} all_reduce {time.monotonic() - t:.3f}s world {world}")
        time.sleep(0.2)
    return "done"


say(f"result {train()}")
