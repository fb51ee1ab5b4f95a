"""Virtual DP replicas: a fixed number of data-parallel replicas, computed by however many
ranks the job has now (:class:`VirtualReplicas`; ``CheckpointConfig.elastic``).

A job that loses a host for good keeps training on the others (issue: elastic shrink)
only if the survivors take over the lost replicas' work: their micro-batches, their RNG
streams, their data positions. So the job's DP degree as its data and its gradient
reduction see it is fixed (``ElasticConfig.num_replicas = R``), and each rank of a DP
degree ``dp`` dividing ``R`` computes ``R / dp`` consecutive replicas in its loop::

    for r in ft.replicas():           # this rank's replicas, in order
        x, y = batch(r, iteration)    # replica r's micro-batches
        schedule.step(x, target=y)
    # the replicas' gradients are reduced here; clip, optimizer.step(), scheduler.step()

Between two replicas of one rank the loop swaps what is each replica's own: the RNG
states and every ``state=`` object but the LR schedulers (which are the job's: stepped
once per iteration, outside the loop); and it keeps each replica's gradients apart. After
the last replica the gradients are reduced over all ``R`` replicas:

- **deterministic** (the default): the replicas' gradients are summed in a fixed binary
  tree over the replicas (:func:`tree_sum`), then divided by ``R``: the same additions in
  the same order whatever ``dp`` is, so a run that shrinks from 2 to 1 rank per stage (or
  grows back) stays bit-identical to the run that never changed. Each rank sums its own
  replicas' subtree; two ranks add their halves with one all-reduce (the plain
  all-reduce's cost); more ranks all-gather their subtree sums;
- otherwise: each rank sums its replicas in order, then one all-reduce (the same
  samples; after a change of ``dp`` the sums associate differently).

What the loop consumes outside ``ft.replicas()`` (an RNG draw, a counter of a
``state=`` object other than an LR scheduler) is not a replica's and would differ after
a shrink: keep it inside.

Buffers a forward updates (BatchNorm's running statistics) end every iteration as the
first replica's, as DDP's ``broadcast_buffers`` makes them: each hosted replica's body
starts from the buffers the iteration began with, the first replica's result is kept,
and at the reduction the stage's DP ranks take replica 0's (a broadcast from the rank
hosting it). So the buffers too are the same bits whatever ``dp`` is, with no per-replica
copy in the checkpoint: at an iteration boundary every replica holds replica 0's.

Each replica's records are in the checkpoint under its virtual index
(``extra.state.dp<r>.<key>``, :mod:`baft.pipeline.replicas`), so the layout is the same
for every ``dp``: a restore after a shrink or a grow finds every replica's records.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from baft.config import ElasticConfig, dp_degree
from baft.pipeline.encoding import local
from baft.pipeline.layout import uses_fsdp
from baft.pipeline.state import TrainingState

if TYPE_CHECKING:
    from baft.pipeline.step import StepRunner

__all__ = ["VirtualReplicas", "dp_degree", "elastic_dp"]

log = logging.getLogger("baft")


class VirtualReplicas:
    """One rank's virtual replicas: their own records between bodies, their gradients
    apart until the reduction. ``hosted``: the replicas this rank computes (consecutive),
    ``num_replicas``: all of them; ``dp_group``: the stage's DP ranks (None with one)."""

    def __init__(
        self,
        state: TrainingState,
        params: Sequence[torch.nn.Parameter],
        *,
        hosted: Sequence[int],
        num_replicas: int,
        deterministic: bool,
        dp_group: dist.ProcessGroup | None,
    ) -> None:
        self.state = state
        self.params = list(params)
        self.hosted = tuple(hosted)
        self.num_replicas = num_replicas
        self.deterministic = deterministic
        self.dp_group = dp_group
        sched = set(state.lr_scheduler_keys())
        self.keys = [k for k in sorted(state.stateful) if k not in sched]
        """The ``state=`` objects that are each replica's own (all but LR schedulers)."""
        self.live_records = state.replica_records(self.keys)
        self.saved: dict[int, list[torch.Tensor]] = {
            r: [t.clone() for t in self.live_records] for r in self.hosted
        }
        """Each hosted replica's records as of its last body's end (the live objects hold
        the last replica's)."""
        self._live = self.hosted[0]
        self.buffers = _StageBuffers(state)
        """The stage's persistent buffers: each replica's body starts from the
        iteration's, and the iteration ends with replica 0's."""
        self._grads: dict[int, list[torch.Tensor | None]] = {}
        self._bufs: dict[int, torch.Tensor] = {}
        self.reduced = False
        """The open iteration's gradients are reduced (its replicas' loop ended)."""

    # ------------------------------------------------------------------ records
    def record(self, r: int, live: torch.Tensor) -> torch.Tensor:
        """Replica ``r``'s bytes of the record whose live tensor is ``live``: its saved
        copy for its own records, the live record for the job's (LR schedulers). A rank
        with one replica keeps no copies: its live records are that replica's, captured
        after each step as without elastic replicas."""
        if len(self.hosted) == 1:
            return live
        for j, t in enumerate(self.live_records):
            if t is live:
                return self.saved[r][j]
        return live

    def restored(self, copy_of: Callable[[int, torch.Tensor], torch.Tensor]) -> None:
        """After a restore: every hosted replica's records from the restored bytes
        (``copy_of(r, live)``: replica ``r``'s copy of the record ``live``); the live
        objects hold the first hosted replica's (:meth:`TrainingState.apply`)."""
        for r in self.hosted:
            for dst, live in zip(self.saved[r], self.live_records, strict=True):
                dst.copy_(copy_of(r, live))
        self._live = self.hosted[0]

    def fresh_start(self) -> None:
        """A job starting at iteration 0: every hosted replica starts from this rank's
        records as they are now (its RNG as the script seeded it, its ``state=`` objects)."""
        self.state.capture(buffers=False, rng=True, optimizer=False, state=self.keys)
        for r in self.hosted:
            for dst, src in zip(self.saved[r], self.live_records, strict=True):
                dst.copy_(src)
        self._live = self.hosted[0]

    def _load(self, r: int) -> None:
        for dst, src in zip(self.live_records, self.saved[r], strict=True):
            dst.copy_(src)
        self.state.load_replica_records(self.keys)
        self._live = r

    def _save(self, r: int) -> None:
        self.state.capture(buffers=False, rng=True, optimizer=False, state=self.keys)
        for dst, src in zip(self.saved[r], self.live_records, strict=True):
            dst.copy_(src)

    # ------------------------------------------------------------------ the loop
    def check_reduced(self) -> None:
        """At ``optimizer.step()``: the iteration's replicas' loop ran to its end (its
        gradients are reduced); else RuntimeError with the loop to write."""
        if not self.reduced:
            raise RuntimeError(
                "optimizer.step() without the replicas' loop: with elastic replicas "
                "(CheckpointConfig.elastic) run each iteration's forward and backward as "
                "'for r in ft.replicas(): schedule.step(<replica r's micro-batches>)' "
                "(it reduces the gradients at its end), then clip and step"
            )
        self.reduced = False

    def run(self, runner: StepRunner) -> Iterator[int]:
        """:meth:`loop` in ``runner``'s iteration: the reduction is its slot
        (``dp_allreduce``) and the step's loss is the mean over the replicas'."""
        losses: list[torch.Tensor] = []

        def reduce(fn: Callable[[], None]) -> None:
            tl = runner._begin()
            with runner.section(f"iteration {tl.iteration}"):
                runner.protected.slot(tl, "dp_allreduce", "collective", fn)
            runner._losses = losses

        for r in self.loop(reduce):
            yield r
            losses.extend(x for x in runner._losses if isinstance(x, torch.Tensor))
            runner._losses = []

    def loop(self, reduce: Callable[[Callable[[], None]], None]) -> Iterator[int]:
        """Yield each hosted replica with its own records loaded; keep its gradients
        apart; after the last, ``reduce(fn)`` runs the reduction (``fn``: post it and
        wait, the caller's slot)."""
        self.reduced = False
        self._grads = {}
        swap = len(self.hosted) > 1  # one replica: its records are the live ones
        start = self.buffers.values() if swap else []
        first: list[torch.Tensor] | None = None
        for i, r in enumerate(self.hosted):
            if swap and self._live != r:
                self._load(r)
            if i:
                self.buffers.set(start)  # this replica's forward from the iteration's
            yield r
            self._grads[r] = [p.grad for p in self.params]
            if swap:
                self._save(r)
                for p in self.params:
                    p.grad = None
            if i == 0 and swap:
                first = self.buffers.values()
        if first is not None:
            self.buffers.set(first)
        reduce(self._reduce)
        self.reduced = True

    def _flat(self, r: int) -> torch.Tensor:
        """Replica ``r``'s gradients as one flat tensor, in a buffer kept across
        iterations (a fresh one per iteration costs its page faults: ~50 ms per 50 MiB)."""
        grads = self._grads[r]
        parts = [
            (local(g) if g is not None else torch.zeros_like(local(p))).reshape(-1)
            for p, g in zip(self.params, grads, strict=True)
        ]
        if not parts:
            return torch.zeros(0)
        n = sum(x.numel() for x in parts)
        buf = self._bufs.get(r)
        if buf is None or buf.numel() != n or buf.dtype != parts[0].dtype:
            buf = self._bufs[r] = torch.empty(n, dtype=parts[0].dtype, device=parts[0].device)
        torch.cat(parts, out=buf)
        return buf

    def _reduce(self) -> None:
        """The replicas' summed gradients over ``num_replicas``, into ``p.grad``.

        Deterministic: the sum is a fixed binary tree over the replicas
        (:func:`tree_sum`), whatever the ranks computing them: each rank sums the subtree
        of its consecutive replicas, and when the job's two halves are two ranks' subtrees
        (two DP ranks: the common shrink from two hosts to one) one all-reduce adds them
        (a sum of two is the same bits in either order, so it costs what the plain
        all-reduce costs); otherwise every rank's subtree sums are all-gathered and added
        in the tree's order."""
        flats = [self._flat(r) for r in self.hosted]
        ranks = dist.get_world_size(self.dp_group) if self.dp_group is not None else 1
        if not self.deterministic:
            acc = tree_sum(flats)
            if ranks > 1:
                dist.all_reduce(acc, group=self.dp_group)
        elif ranks == 1:
            acc = tree_sum(flats)
        elif is_subtree_split(self.num_replicas, len(flats), ranks):
            acc = tree_sum(flats)  # this rank's half of the tree
            dist.all_reduce(acc, group=self.dp_group)
        elif blocks_are_subtrees(self.num_replicas, len(flats)):
            mine = tree_sum(flats)
            every = [torch.empty_like(mine) for _ in range(ranks)]
            dist.all_gather(every, mine, group=self.dp_group)
            acc = tree_sum(every, sizes=[len(flats)] * ranks)
        else:  # a rank's replicas are no subtree: every replica's own gradients
            mine = torch.cat(flats)
            gathered = [torch.empty_like(mine) for _ in range(ranks)]
            dist.all_gather(gathered, mine, group=self.dp_group)
            acc = tree_sum([x for g in gathered for x in g.chunk(len(flats))])
        acc.div_(self.num_replicas)
        if ranks > 1:
            self.buffers.broadcast(self.dp_group)
        offset = 0
        for p in self.params:
            n = local(p).numel()
            g = acc[offset : offset + n].view_as(local(p))
            if p.grad is None:  # a TP parameter's gradient is a DTensor of its placements
                p.grad = (
                    DTensor.from_local(
                        g.clone(), p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
                    )
                    if isinstance(p, DTensor)
                    else g.clone()
                )
            else:
                local(p.grad).copy_(g)
            offset += n


class _StageBuffers:
    """The stage's persistent buffers (:meth:`TrainingState.live_buffers`: looked up live
    each time, a module may replace a buffer rather than update it)."""

    def __init__(self, state: TrainingState) -> None:
        self._live = state.live_buffers

    def values(self) -> list[torch.Tensor]:
        return [b.detach().clone() for b in self._live()]

    @torch.no_grad()
    def set(self, values: Sequence[torch.Tensor]) -> None:
        for live, v in zip(self._live(), values, strict=True):
            live.copy_(v)

    @torch.no_grad()
    def broadcast(self, group: dist.ProcessGroup | None) -> None:
        """Every DP rank of the stage takes replica 0's (its DP rank 0 hosts it)."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for b in self._live():
            by_dtype.setdefault(b.dtype, []).append(b)
        for bufs in by_dtype.values():  # one message per dtype, not one per buffer
            flat = torch.cat([b.reshape(-1) for b in bufs])
            dist.broadcast(flat, group=group, group_src=0)
            for b, v in zip(bufs, flat.split([b.numel() for b in bufs]), strict=True):
                b.copy_(v.view_as(b))


def _split(n: int) -> int:
    """Where the tree over ``n`` leaves splits: the largest power of two below ``n``."""
    return 1 << ((n - 1).bit_length() - 1)


def tree_sum(parts: Sequence[torch.Tensor], sizes: Sequence[int] | None = None) -> torch.Tensor:
    """The sum of ``parts`` in a fixed binary tree: ``tree(n) = tree(first m) + tree(rest)``
    with ``m`` the largest power of two below ``n``. ``sizes``: each part is already the
    tree sum of that many leaves (a rank's consecutive replicas), so the shape over the
    leaves is the same. The result may be one of ``parts`` (summed into in place)."""
    sizes = list(sizes) if sizes is not None else [1] * len(parts)
    if len(parts) == 1:
        return parts[0]
    m, leaves = _split(sum(sizes)), 0
    for i, k in enumerate(sizes):
        if leaves == m:
            left, right = tree_sum(parts[:i], sizes[:i]), tree_sum(parts[i:], sizes[i:])
            return left.add_(right)
        leaves += k
    raise ValueError(f"parts of {sizes} leaves are no subtrees of the tree over {sum(sizes)}")


def blocks_are_subtrees(num_replicas: int, per_rank: int) -> bool:
    """Whether every rank's ``per_rank`` consecutive replicas are a subtree of the tree
    over ``num_replicas`` (:func:`tree_sum`)."""
    nodes: set[tuple[int, int]] = set()
    todo = [(0, num_replicas)]
    while todo:
        lo, hi = todo.pop()
        nodes.add((lo, hi))
        if hi - lo > 1:
            m = lo + _split(hi - lo)
            todo += [(lo, m), (m, hi)]
    return all((lo, lo + per_rank) in nodes for lo in range(0, num_replicas, per_rank))


def is_subtree_split(num_replicas: int, per_rank: int, ranks: int) -> bool:
    """Whether ``ranks`` ranks of ``per_rank`` consecutive replicas each are the two
    halves of the tree over ``num_replicas`` (then one all-reduce of two adds them)."""
    return ranks == 2 and _split(num_replicas) == per_rank


def attach(runner: StepRunner, config: ElasticConfig) -> None:
    """Give ``runner`` the virtual replicas ``config`` asks for (none with
    ``num_replicas`` 0), or refuse what they cannot serve yet (ValueError): FSDP2
    (``dp_shard``, HSDP), whose parameters are sharded over the DP ranks and whose
    gradients FSDP2 reduces itself. Tensor-parallel DTensor parameters are served: the
    replicas of one TP rank reduce its local shards over its DP group, and a resize
    never changes the TP degree."""
    if not config.num_replicas:
        return
    if runner.averaged_by or uses_fsdp(runner.state.modules):
        raise ValueError(
            "elastic replicas (CheckpointConfig.elastic.num_replicas) take plain DP "
            "replicas for now: this job shards its parameters with FSDP2 (dp_shard or "
            "HSDP), whose shards move when the DP degree does; run it without elastic "
            "replicas (tensor parallelism alone is served)"
        )
    topo = runner.mesh.topology
    runner.elastic = VirtualReplicas(
        runner.state, runner.params,
        hosted=config.hosted(topo.num_dp, topo.coords(runner.mesh.rank).dp),
        num_replicas=config.num_replicas, deterministic=config.deterministic,
        dp_group=runner.mesh.dp_group if topo.num_dp > 1 else None,
    )  # fmt: skip


def protection(redundancy: str, persist_every: int, topology: Any) -> tuple[str, int, str]:
    """The redundancy and persist cadence an elastic job runs with on ``topology``:
    as configured when its coding groups fit the nodes left; otherwise the widest code
    that fits (``none`` on one node) and a DCP checkpoint of every version until the job
    grows back, with the warning to log (empty when nothing changed)."""
    from baft.store.coding import coding_groups
    from baft.store.policy import Redundancy

    try:
        coding_groups(topology, Redundancy.parse(redundancy))
        return redundancy, persist_every, ""
    except ValueError:
        pass
    nodes = topology.num_nodes
    fallback = f"replicate:{nodes - 1}" if nodes > 1 else "none"
    why = (
        f"elastic replicas: {redundancy} needs more nodes than the {nodes} this job runs on "
        f"now; protecting with {fallback}, which cannot survive losing another host, and "
        "persisting every version to DCP until the job grows back"
    )
    return fallback, 1, why


def elastic_dp(num_replicas: int, model_ranks: int, *, poll_s: float = 1.0) -> int:
    """This world's DP degree for ``num_replicas`` elastic replicas (call before building
    the mesh; the world size is the process group's, or torchrun's ``WORLD_SIZE``). When the world cannot hold every
    stage (:func:`dp_degree` is None: torchrun formed it from the hosts left, and a
    stage's only copy is gone), the job does not shrink: this logs why and waits, and
    torchrun restarts the workers when a host joins (a membership change), as a job of
    fixed size waits for its replacement."""
    import os
    import time

    world = dist.get_world_size() if dist.is_initialized() else int(os.environ["WORLD_SIZE"])
    dp = dp_degree(num_replicas, world, model_ranks)
    if dp is not None:
        return dp
    log.warning(
        "elastic replicas: %d ranks cannot hold a copy of every stage (%d ranks each) with "
        "a DP degree dividing %d replicas: not shrinking, waiting for a host to join "
        "(torchrun restarts the job when one does)", world, model_ranks, num_replicas,
    )  # fmt: skip
    waited = 0.0
    while True:  # the agent sees a healthy worker; a joining host ends it
        time.sleep(poll_s)
        waited += poll_s
        if waited % 60 < poll_s:
            log.warning("elastic replicas: still waiting for a host (%.0f s)", waited)
