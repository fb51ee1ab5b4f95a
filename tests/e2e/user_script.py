"""A user's own pipelining script in the README quickstart shape, for the fault matrix.

Run it like a user would (one process per rank; add ``-m baft.inprocess`` before the
script for in-process recovery):

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc-per-node 2 \\
        tests/e2e/user_script.py --out runs/user            # protected by baft
    ... tests/e2e/user_script.py --out runs/ref --unprotected  # the same loop, no baft

Every stage is a *fresh* ``nn.Sequential`` (so every stage has the same parameter names,
``0.weight``...) unless ``--unique-fqns`` wraps stage ``s`` as ``stage{s}.``; stage 0 has
BatchNorm (buffers), every stage dropout (the RNG); SGD-nesterov, a warmup + cosine LR
schedule, gradient clipping and a sampler whose position is in ``state=``. With
``--dp N`` the loop averages gradients over the ``dp`` dim itself (and broadcasts the
BatchNorm buffers from the first replica, as DDP does), so replicas hold identical bytes.
What real scripts have, on flags: ``--loader-workers N`` feeds the batches through a
``DataLoader`` with ``N`` persistent worker processes (created inside ``main()``, resumed
at the iteration ``restore()`` returns); ``--module-socket`` opens a TCP connection at
module level (outside ``main()``, as a metrics or data-service client is) and uses it every
iteration; ``--after-close S`` works ``S`` seconds after ``ft.close()`` on the last stage
(saving a model, finishing a logger) and then writes ``after_close.rank{r}``.
Both modes write ``state.rank{r}.json`` (digests of every parameter, buffer, optimizer,
scheduler, sampler and RNG state) and ``losses.attempt{start}.json``; a protected run is
bit-identical to the unprotected one when the two sets of files are equal.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import socket
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

WIDTH, CLASSES, DATASET, BATCH_PER_REPLICA = 32, 10, 256, 8
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def make_stage(stage: int, num_stages: int, unique: bool) -> nn.Module:
    torch.manual_seed(1234 + stage)
    layers: list[nn.Module] = [nn.Linear(WIDTH, WIDTH)]
    if stage == 0:
        layers.append(nn.BatchNorm1d(WIDTH))
    layers += [nn.GELU(), nn.Dropout(0.1)]
    if stage == num_stages - 1:
        layers.append(nn.Linear(WIDTH, CLASSES))
    seq = nn.Sequential(*layers)
    return nn.Sequential(OrderedDict([(f"stage{stage}", seq)])) if unique else seq


class ShuffleSampler:
    """Batches of dataset indices, reshuffled every epoch; its position is its state."""

    def __init__(self, size: int, batch: int, seed: int) -> None:
        self.size, self.batch, self.seed = size, batch, seed
        self.epoch, self.position = 0, 0

    def next_batch(self) -> list[int]:
        if self.position + self.batch > self.size:
            self.epoch, self.position = self.epoch + 1, 0
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.size, generator=g)
        out = order[self.position : self.position + self.batch].tolist()
        self.position += self.batch
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.position = state["epoch"], state["position"]


def indices_for(it: int, dp: int) -> list[int]:
    """The dataset indices of iteration ``it`` (every replica's), as the ShuffleSampler
    gives them: a stateless form for the DataLoader's workers."""
    batch = BATCH_PER_REPLICA * dp
    per_epoch = DATASET // batch
    epoch, position = divmod(it, per_epoch)
    order = torch.randperm(DATASET, generator=torch.Generator().manual_seed(7 + epoch))
    return order[position * batch : (position + 1) * batch].tolist()


class IterationData(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Item ``it``: iteration ``it``'s batch of this replica (built in a worker process)."""

    def __init__(self, inputs: torch.Tensor, labels: torch.Tensor, dp: int, num_dp: int) -> None:
        self.inputs, self.labels, self.dp, self.num_dp = inputs, labels, dp, num_dp

    def __len__(self) -> int:
        return 1 << 20

    def __getitem__(self, it: int) -> tuple[torch.Tensor, torch.Tensor]:
        index = indices_for(it, self.num_dp)[self.dp :: self.num_dp]
        return self.inputs[index], self.labels[index]


class EchoLink:
    """A TCP connection opened at module level (both ends in this process: an echo
    thread), used once per iteration as a metrics client would be."""

    def __init__(self) -> None:
        server = socket.create_server(("127.0.0.1", 0))
        self.client = socket.create_connection(server.getsockname())
        peer, _ = server.accept()
        server.close()
        threading.Thread(target=self._echo, args=(peer,), daemon=True).start()
        self.sent = 0

    @staticmethod
    def _echo(peer: socket.socket) -> None:
        while data := peer.recv(64):
            peer.sendall(data)

    def use(self, it: int) -> None:
        msg = f"{it:08d}".encode()
        self.client.sendall(msg)
        got = b""
        while len(got) < len(msg):
            chunk = self.client.recv(64)
            if not chunk:
                raise ConnectionError("the module-level connection was closed")
            got += chunk
        assert got == msg, (got, msg)
        self.sent += 1


LINK: EchoLink | None = None


def sha(t: torch.Tensor) -> str:
    raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(raw).hexdigest()


def plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return {"sha256": sha(value), "dtype": str(value.dtype), "shape": list(value.shape)}
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return repr(value)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--iterations", type=int, default=16)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--schedule", choices=sorted(SCHEDULES), default="1f1b")
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--unique-fqns", action="store_true")
    p.add_argument("--redundancy", default="xor:2")
    p.add_argument("--persist-every", type=int, default=0)
    p.add_argument("--full-every", type=int, default=0, help="0 = auto")
    p.add_argument("--ranks-per-node", type=int, default=0)
    p.add_argument("--store-root", default="/dev/shm/baft")
    p.add_argument("--job-id", default="")
    p.add_argument("--timeout", type=float, default=10.0)
    p.add_argument("--unprotected", action="store_true")
    p.add_argument("--sleep", type=float, default=0.0, help="seconds per iteration (a window)")
    p.add_argument("--loader-workers", type=int, default=0)
    p.add_argument("--module-socket", action="store_true")
    p.add_argument("--after-close", type=float, default=0.0)
    p.add_argument("--inject", action="append", default=[], help="a baft fault spec (tests)")
    return p.parse_args()


def main() -> None:  # noqa: PLR0915 - one straight user loop
    a = parse()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    num_pp = world // a.dp
    mesh = init_device_mesh("cpu", (num_pp, a.dp, 1), mesh_dim_names=("pp", "dp", "tp"))
    pp, dp = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    dp_group = mesh.get_group("dp")
    module = make_stage(pp, num_pp, a.unique_fqns)
    stage = PipelineStage(module, pp, num_pp, torch.device("cpu"), group=mesh.get_group("pp"))
    schedule = SCHEDULES[a.schedule](
        stage, n_microbatches=a.microbatches, loss_fn=nn.functional.cross_entropy
    )
    optimizer = torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=3)
    decay = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=a.iterations)
    scheduler = torch.optim.lr_scheduler.SequentialLR(optimizer, [warmup, decay], milestones=[3])
    sampler = ShuffleSampler(DATASET, BATCH_PER_REPLICA * a.dp, seed=7)
    g = torch.Generator().manual_seed(0)
    inputs = torch.randn(DATASET, WIDTH, generator=g)
    labels = torch.randint(0, CLASSES, (DATASET,), generator=g)
    torch.manual_seed(99)

    start, ft = 0, None
    if not a.unprotected:
        import baft

        ft = baft.protect(
            schedule=schedule,
            stages=[stage],
            optimizer=optimizer,
            run_dir=a.out,
            device_mesh=mesh,
            checkpoint=baft.CheckpointConfig(
                policy=baft.CheckpointPolicy(
                    redundancy=a.redundancy, persist_every=a.persist_every, full_every=a.full_every
                ),
                profile_iters=2,
                cost={"copy_Bps": 1e9},
                store=baft.StoreConfig(root=a.store_root, job_id=a.job_id),
                timeouts=baft.TimeoutConfig(collective_s=a.timeout),
            ),
            ranks_per_node=a.ranks_per_node,
            state={"lr_scheduler": scheduler, "sampler": sampler},
            average_gradients=False if a.dp > 1 else None,
        )
        if a.inject:
            ft.inject(a.inject)
        start = ft.restore()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    losses: dict[int, float] = {}
    batches = None
    if a.loader_workers:
        loader = torch.utils.data.DataLoader(
            IterationData(inputs, labels, dp, a.dp),
            sampler=range(start, a.iterations),
            batch_size=None,
            num_workers=a.loader_workers,
            persistent_workers=True,
            generator=torch.Generator().manual_seed(5),  # not the global RNG (dropout's)
        )
        batches = iter(loader)
    for it in range(start, a.iterations):
        index = sampler.next_batch()[dp :: a.dp]
        x, y = inputs[index], labels[index]
        if batches is not None:
            x, y = next(batches)
            assert index == indices_for(it, a.dp)[dp :: a.dp], it
        if LINK is not None:
            LINK.use(it)
        optimizer.zero_grad()
        mb_losses: list[torch.Tensor] = []
        if pp == 0:
            schedule.step(x)
        elif pp == num_pp - 1:
            schedule.step(target=y, losses=mb_losses)
        else:
            schedule.step()
        if a.dp > 1:
            for p in module.parameters():
                assert p.grad is not None
                dist.all_reduce(p.grad, group=dp_group)
                p.grad.div_(a.dp)
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        if a.dp > 1:
            for b in module.buffers():
                dist.broadcast(b, group=dp_group, group_src=0)
        if mb_losses:
            losses[it] = float(torch.stack(mb_losses).detach().mean())
        time.sleep(a.sleep)
    if ft is not None:
        ft.close()
    if a.after_close and pp == num_pp - 1:
        time.sleep(a.after_close)  # e.g. saving the model, finishing a logger
        (out / f"after_close.rank{rank}").write_text(str(a.after_close))
    state = {
        "module": plain(module.state_dict()),
        "optimizer": plain(optimizer.state_dict()),
        "scheduler": plain(scheduler.state_dict()),
        "sampler": sampler.state_dict(),
        "rng": sha(torch.get_rng_state()),
    }
    (out / f"state.rank{rank}.json").write_text(json.dumps(state, indent=1))
    if pp == num_pp - 1 and dp == 0:
        (out / f"losses.attempt{start}.json").write_text(json.dumps(losses))
    dist.destroy_process_group()


if __name__ == "__main__":
    import sys

    import baft

    if "--module-socket" in sys.argv:
        LINK = EchoLink()  # outside main(): must survive a peer's recovery
    baft.run(main)  # under `-m baft.inprocess`: survivors re-enter main() after a failure
