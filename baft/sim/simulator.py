"""Pure discrete-event simulator of one training iteration of a pipeline schedule.

Each pipeline rank runs its actions in order; an action starts when the rank is free and
its inputs have arrived (F of stage s needs F of s-1, B/I needs the rank's own F and the
input gradient of s+1, W needs its own I). Crossing ranks, a transfer rendezvous as on
gloo and NCCL: it starts once the sender fired it and the receiver posted its receive,
and takes ``p2p_s``; the sender waits for it where torch's implementation of the
schedule waits (``baft.sim.schedules.send_waits``), which can idle a sender behind a
slower receiver. After its last action a rank joins the DP all-reduce (``dp_allreduce_s``, not
overlapped with backward), then every rank waits for the slowest before the optimizer
step (the gradient-norm all-reduce of torchtitan/Megatron is a global barrier).

Every wait becomes a slot: "w0", "w1", ... (blocking waits in order), "dp_allreduce"
(kind "collective") and "pre_step". A CheckpointPlan is replayed by running each slot's
tasks when the rank reaches it: the next action starts at max(inputs arrived, tasks
done), and checkpoint work that overlaps an incoming transfer slows that transfer by
``p2p_contention`` (they share the rank's PCIe/NIC link). Spilled tasks run before the
step. A ``Background`` load (naive async checkpointing) slows compute and links of a rank
from the start of the iteration instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from baft.plan.types import BubbleMap, CheckpointPlan, Slot, Task
from baft.sim.events import (
    Background,
    Interval,
    Pipe,
    Run,
    StageTimes,
    overlap,
    run_pipeline,
)
from baft.sim.schedules import num_stages
from baft.topology import Topology

__all__ = ["Background", "Interval", "SimResult", "StageTimes", "simulate"]

COLLECTIVE_SLOT = "dp_allreduce"
PRE_STEP = "pre_step"


@dataclass(frozen=True, slots=True)
class SimResult:
    """One simulated iteration (per pipeline rank; DP/TP replicas behave alike)."""

    schedule: str
    num_stages_pp: int
    num_microbatches: int
    num_virtual: int
    timeline: dict[int, tuple[Interval, ...]]
    """Per pipeline rank (with a plan: its checkpoint iteration, slowest pipeline)."""
    blocked_s: dict[int, float]
    """Per pipeline rank: idle seconds of the base iteration (all slots)."""
    iteration_s: float
    """Iteration seconds (with a plan: mean over its interval; with a background load)."""
    base_iteration_s: float
    """Iteration seconds without checkpoint work."""
    checkpoint_iteration_s: float
    """Slowest single iteration with the plan or background load applied."""
    bubble_fraction: float
    """Mean over ranks of (pipeline waits + pre-step idle) / base iteration."""
    slots: dict[int, tuple[Slot, ...]]
    """Per pipeline rank: the base iteration's slots."""

    @property
    def exposed_s(self) -> float:
        """Extra seconds per iteration caused by checkpoint work."""
        return self.iteration_s - self.base_iteration_s

    def bubble_maps(self, topology: Topology | None = None) -> dict[int, BubbleMap]:
        """BubbleMap per pipeline rank, or per global rank of ``topology`` (by pp)."""
        if topology is None:
            return {
                r: BubbleMap(rank=r, slots=s, iteration_s=self.base_iteration_s)
                for r, s in self.slots.items()
            }
        if topology.num_pp != self.num_stages_pp:
            raise ValueError(f"topology has pp={topology.num_pp}, simulation {self.num_stages_pp}")
        return {
            g: BubbleMap(
                rank=g, slots=self.slots[topology.coords(g).pp], iteration_s=self.base_iteration_s
            )
            for g in range(topology.world_size)
        }


@dataclass(slots=True)
class _Load:
    """Checkpoint seconds of one pipeline rank in one iteration, by place."""

    slots: dict[int, float] = field(default_factory=dict)
    """Action index -> seconds of the slot's tasks run right before it."""
    collective: float = 0.0
    pre_step: float = 0.0
    spill: float = 0.0


def _durations(times: StageTimes, count: int) -> dict[str, tuple[float, ...]]:
    fwd, bwd = times.per_stage(count)
    wf = times.weight_fraction
    return {
        "F": tuple(f + times.tp_s for f in fwd),
        "B": tuple(b + times.tp_s for b in bwd),
        "I": tuple(b * (1.0 - wf) + times.tp_s for b in bwd),
        "W": tuple(b * wf for b in bwd),
    }


def _end_phase(
    runs: Mapping[int, Run],
    loads: Mapping[tuple[int, int], _Load],
    times: StageTimes,
    background: Mapping[int, Background],
) -> tuple[float, dict[tuple[int, int], tuple[float, float, float]]]:
    """DP all-reduce per stage rank, then the global barrier.

    Returns the barrier time and per (dp, rank): (finish, all-reduce end, ready for step).
    """
    ranks = sorted(next(iter(runs.values())).finish)
    marks: dict[tuple[int, int], tuple[float, float, float]] = {}
    barrier = 0.0
    for r in ranks:
        start = max(run.finish[r] for run in runs.values())
        extra = 0.0
        if times.dp_allreduce_s > 0.0:
            for dp, run in runs.items():
                load = loads.get((dp, r), _Load())
                t0 = run.finish[r]
                share = overlap(t0, t0 + load.collective, start, start + times.dp_allreduce_s)
                extra = max(extra, share * (times.p2p_contention - 1.0))
        ar_end = start + times.dp_allreduce_s + extra
        for dp, run in runs.items():
            load = loads.get((dp, r), _Load())
            ready = max(ar_end, run.finish[r] + load.collective)
            done = max(
                ready + load.pre_step + load.spill, background.get(r, Background()).done_by_step_s
            )
            marks[(dp, r)] = (run.finish[r], ar_end, ready)
            barrier = max(barrier, done)
    return barrier, marks


def _base_slots(
    run: Run,
    marks: Mapping[tuple[int, int], tuple[float, float, float]],
    barrier: float,
    times: StageTimes,
) -> tuple[dict[int, tuple[Slot, ...]], dict[int, dict[str, int]]]:
    """Slots of the base iteration and where each "w<k>" sits in the action list."""
    eps = 1e-9 * max(barrier, 1e-12)
    slots: dict[int, tuple[Slot, ...]] = {}
    where: dict[int, dict[str, int]] = {}
    for r in sorted(run.finish):
        out: list[Slot] = []
        where[r] = {}
        for idx, idle in run.waits[r]:
            if idle > eps:
                sid = f"w{len(out)}"
                out.append(Slot(slot_id=sid, idle_s=idle, kind="p2p"))
                where[r][sid] = idx
        _, ar_end, ready = marks[(0, r)]
        if times.dp_allreduce_s > 0.0:
            out.append(
                Slot(slot_id=COLLECTIVE_SLOT, idle_s=times.dp_allreduce_s, kind="collective")
            )
        out.append(Slot(slot_id=PRE_STEP, idle_s=max(0.0, barrier - ready), kind="pre_step"))
        slots[r] = tuple(out)
    return slots, where


def _loads(
    plan: CheckpointPlan,
    topology: Topology,
    where: Mapping[int, Mapping[str, int]],
    lags: tuple[int, ...],
) -> dict[tuple[int, int], _Load]:
    """Per (dp, pp) the checkpoint seconds of the plan's tasks with a lag in ``lags``;
    TP peers move in lockstep, so the slowest of them counts."""
    loads: dict[tuple[int, int], _Load] = {}
    for g, rp in plan.ranks.items():
        c = topology.coords(g)
        load = loads.setdefault((c.dp, c.pp), _Load())
        for sid, tasks in rp.tasks.items():
            secs = _seconds(tasks, lags)
            if sid == COLLECTIVE_SLOT:
                load.collective = max(load.collective, secs)
            elif sid == PRE_STEP:
                load.pre_step = max(load.pre_step, secs)
            elif sid in where[c.pp]:
                idx = where[c.pp][sid]
                load.slots[idx] = max(load.slots.get(idx, 0.0), secs)
            else:
                raise ValueError(
                    f"plan rank {g} uses slot {sid!r}, which the simulated schedule does not "
                    f"have at pp={c.pp}: plan from this simulation's bubble_maps()"
                )
        load.spill = max(load.spill, _seconds(rp.spilled, lags))
    return loads


def _seconds(tasks: tuple[Task, ...], lags: tuple[int, ...]) -> float:
    return sum(t.est_s for t in tasks if t.lag in lags)


def _iteration(
    pipe: Pipe,
    times: StageTimes,
    durations: Mapping[str, tuple[float, ...]],
    loads: Mapping[tuple[int, int], _Load],
    num_dp: int,
    background: Mapping[int, Background],
) -> tuple[float, dict[int, tuple[Interval, ...]], Run, dict]:
    """Run every DP pipeline (identical ones once) and the end phase."""
    orders = pipe.orders
    cache: dict[tuple, Run] = {}
    runs: dict[int, Run] = {}
    for dp in range(num_dp):
        work = {
            (r, idx): s
            for r in orders
            for idx, s in loads.get((dp, r), _Load()).slots.items()
            if s > 0.0
        }
        key = tuple(sorted(work.items()))
        if key not in cache:
            cache[key] = run_pipeline(pipe, times, durations, work, background)
        runs[dp] = cache[key]
    barrier, marks = _end_phase(runs, loads, times, background)
    slowest = max(runs, key=lambda dp: (max(marks[(dp, r)][2] for r in orders), -dp))
    timeline: dict[int, tuple[Interval, ...]] = {}
    for r in orders:
        finish, ar_end, ready = marks[(slowest, r)]
        load = loads.get((slowest, r), _Load())
        spans = list(runs[slowest].timeline[r])
        if load.collective > 0.0:
            spans.append(Interval(finish, finish + load.collective, "ckpt", COLLECTIVE_SLOT))
        if ar_end > finish:
            spans.append(Interval(finish, ar_end, "allreduce", "dp all-reduce"))
        t = ready
        for kind, secs in (("ckpt", load.pre_step), ("spill", load.spill)):
            if secs > 0.0:
                spans.append(Interval(t, t + secs, kind, kind))
                t += secs
        if barrier > t:
            spans.append(Interval(t, barrier, "pre_step", "wait for step"))
        if times.optimizer_s > 0.0:
            spans.append(Interval(barrier, barrier + times.optimizer_s, "step", "optimizer"))
        timeline[r] = tuple(sorted(spans, key=lambda s: (s.start, s.end)))
    return barrier + times.optimizer_s, timeline, runs[0], marks


def _replay(
    plan: CheckpointPlan,
    topo: Topology,
    where: Mapping[int, Mapping[str, int]],
    base_s: float,
    pipe: Pipe,
    times: StageTimes,
    durations: Mapping[str, tuple[float, ...]],
) -> tuple[float, float, dict[int, tuple[Interval, ...]]]:
    """(mean iteration over the plan's interval, slowest iteration, its timeline)."""
    if topo.world_size < max(plan.ranks, default=0) + 1:
        raise ValueError("plan names ranks outside the topology: pass topology=")
    n = plan.interval_iters
    phases = [(0, 1)] if n == 1 else [(0,), (1,)]
    results = [
        _iteration(
            pipe,
            times,
            durations,
            _loads(plan, topo, where, lags),
            topo.num_dp,
            {},
        )
        for lags in phases
    ]
    mean = (sum(res[0] for res in results) + (n - len(results)) * base_s) / n
    return mean, max(res[0] for res in results), results[0][1]


def simulate(
    schedule: str,
    num_stages_pp: int,
    num_microbatches: int,
    times: StageTimes,
    *,
    num_virtual: int = 1,
    plan: CheckpointPlan | None = None,
    topology: Topology | None = None,
    background: Mapping[int, Background] | None = None,
) -> SimResult:
    """Simulate one iteration; optionally replay ``plan`` (global ranks of ``topology``,
    default: one rank per pipeline stage) or a ``background`` load per pipeline rank."""
    pipe = Pipe.build(schedule, num_stages_pp, num_microbatches, num_virtual)
    durations = _durations(times, num_stages(schedule, num_stages_pp, num_virtual))
    topo = topology or Topology(num_pp=num_stages_pp, ranks_per_node=1)
    if topo.num_pp != num_stages_pp:
        raise ValueError(f"topology has pp={topo.num_pp} but num_stages_pp={num_stages_pp}")
    base_s, base_tl, base_run, marks = _iteration(pipe, times, durations, {}, 1, {})
    barrier = base_s - times.optimizer_s
    slots, where = _base_slots(base_run, marks, barrier, times)
    timeline, it_s, worst_s = base_tl, base_s, base_s
    if background:
        it_s, timeline, _, _ = _iteration(pipe, times, durations, {}, 1, background)
        worst_s = it_s
    if plan is not None:
        if background:
            raise ValueError("pass either plan= or background=, not both")
        it_s, worst_s, timeline = _replay(plan, topo, where, base_s, pipe, times, durations)
    fractions = []
    blocked = {}
    for r, ss in slots.items():
        blocked[r] = sum(s.idle_s for s in ss)
        waits = sum(s.idle_s for s in ss if s.kind != "collective")
        fractions.append(waits / base_s if base_s > 0 else 0.0)
    return SimResult(
        schedule=schedule,
        num_stages_pp=num_stages_pp,
        num_microbatches=num_microbatches,
        num_virtual=num_virtual,
        timeline=timeline,
        blocked_s=blocked,
        iteration_s=it_s,
        base_iteration_s=base_s,
        checkpoint_iteration_s=worst_s,
        bubble_fraction=sum(fractions) / len(fractions),
        slots=slots,
    )
