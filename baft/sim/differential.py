"""Pure cluster-scale model of differential checkpoints next to full snapshots.

Per iteration and GPU, ``full_every=1`` protects the GPU's DP share of its stage's whole
state (weights + optimizer state); differential checkpointing with ``full_every=K``
protects the gradient record of the last step plus the largest of ``K`` rotating slices
(``baft/plan/rotation.py``), also split across the DP replicas (after DP averaging the
gradients, like the state, are the same on every replica). For both this module gives
the bytes copied device -> host, the bytes each GPU's NIC sends for redundancy (the
coding module's real stripe layout), the seconds that takes against the idle seconds
the pipeline offers, the host-memory store per GPU, and what recovery adds (fetching
and replaying up to ``K - 1`` records). ``K`` is chosen per pipeline rank with
``choose_full_every`` (the engine's decision function) and the job takes the largest.

Assumptions, stated with the output: copies and sends of one iteration share that
GPU's bubbles one after another (as the planner schedules them); the NIC is the GPU's
own (``Hardware.nic_Bps`` is per GPU); gradients as the optimizer consumes them are
``grad_bytes_per_param`` bytes (4: fp32 main grads, Megatron's default; 2 for bf16).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from baft.plan import names
from baft.plan.rotation import (
    TensorGroup,
    assign_slices,
    choose_full_every,
    payload_nbytes,
    retained_nbytes,
    slice_nbytes,
)
from baft.plan.types import StateLayout, TensorSpec
from baft.sim.presets import Scenario, layouts, rank_tensors
from baft.sim.simulator import simulate
from baft.store.coding import Redundancy, coding_groups, group_layouts

__all__ = [
    "DifferentialModel",
    "RankBytes",
    "bubbles_per_pp",
    "model_differential",
    "payload_layouts",
    "summary_lines",
    "tensor_groups",
    "to_dict",
]

GRAD_BYTES_PER_PARAM = 4
"""Bytes per parameter of the gradients the optimizer consumes (fp32 main grads)."""
WEIGHT_BYTES_PER_PARAM = 2
"""bf16 model weight in ``presets.rank_tensors`` (the ``model.`` tensors)."""


@dataclass(frozen=True, slots=True)
class RankBytes:
    """One pipeline rank (every DP/TP replica of it alike), per GPU and iteration."""

    pp: int
    idle_s: float
    """Idle seconds per iteration the pipeline offers this GPU (its bubbles)."""
    state_nbytes: int
    """Weights + optimizer state of the stage's TP shard (the whole DP group's)."""
    record_nbytes: int
    """Gradient record of the stage's TP shard."""
    slice_nbytes: int
    """Largest full-state slice at ``full_every``."""
    full_every: int
    """The smallest ``K`` this rank alone would need (``choose_full_every``)."""
    reason: str
    """Why, from ``choose_full_every``."""
    full_nbytes: int
    """Full snapshot copied by this GPU (its 1/dp share of the state)."""
    diff_nbytes: int
    """Differential payload copied by this GPU at the job's ``K`` (record + slice) / dp."""
    full_send_nbytes: int
    """Redundancy bytes this GPU's NIC sends per iteration, full snapshots."""
    diff_send_nbytes: int
    """The same, differential."""
    full_s: float
    """Copy + send seconds per iteration, full snapshots."""
    diff_s: float
    """Copy + send seconds per iteration, differential."""
    full_store_nbytes: int
    """Host memory this GPU's store keeps (its snapshots double-buffered + redundancy held)."""
    diff_store_nbytes: int
    """The same, differential (``retained_nbytes``: K+1 payloads padded to the largest
    slice, as the engine stores them)."""


@dataclass(frozen=True, slots=True)
class DifferentialModel:
    """Full snapshots vs differential checkpoints for one scenario."""

    full_every: int
    """``K`` for the job: the largest any pipeline rank needs."""
    reason: str
    """Why this ``K`` (the deciding rank's reason)."""
    fits: bool
    """Whether every GPU's differential copy + send fits its bubbles at ``K``."""
    full_fits: bool
    """Whether full snapshots every iteration fit every GPU's bubbles."""
    iteration_s: float
    rows: tuple[RankBytes, ...]
    nic_Bps: float
    d2h_Bps: float
    redundancy: str
    grad_bytes_per_param: int
    replay_steps: int
    """Steps a recovery replays at most (``K - 1``)."""
    replay_s: float
    """What recovery adds at most: fetch ``K - 1`` whole-stage records over the NIC, copy
    them to the device and run ``K - 1`` optimizer steps."""

    def worst(self, field: str) -> Any:
        """The largest value of a ``RankBytes`` field over the pipeline ranks."""
        return max(getattr(r, field) for r in self.rows)


def tensor_groups(scn: Scenario, pp: int) -> tuple[tuple[TensorGroup, ...], int]:
    """Tensor groups (weight + its master, exp_avg, exp_avg_sq) of pipeline rank ``pp``'s
    TP shard, and the bytes of its gradient record (``GRAD_BYTES_PER_PARAM`` per param)."""
    sizes: dict[str, int] = {}
    params = 0
    for t in rank_tensors(scn, pp):
        name = _group_name(t.name)
        sizes[name] = sizes.get(name, 0) + t.nbytes
        if names.is_model(t.name):
            params += t.nbytes // WEIGHT_BYTES_PER_PARAM
    return tuple(TensorGroup(n, b) for n, b in sizes.items()), params


def payload_layouts(
    scn: Scenario, k: int, grad_bytes_per_param: int = GRAD_BYTES_PER_PARAM
) -> dict[int, StateLayout]:
    """What one differential iteration protects on each global rank, at the largest slice:
    the gradient record (one tensor per weight) and the slice's tensors, as the
    ``StateLayout`` the planner schedules like a full snapshot (DP replicas split it).
    With ``k = 1``: the full state (``presets.layouts``)."""
    if k == 1:
        return layouts(scn)
    topo = scn.topology
    per_pp = []
    for pp in range(topo.num_pp):
        groups, _ = tensor_groups(scn, pp)
        a = assign_slices(groups, k)
        sizes = slice_nbytes(groups, a, k)
        worst = max(range(k), key=lambda j: (sizes[j], -j))
        members = {g.name for g, j in zip(groups, a, strict=True) if j == worst}
        record = [
            TensorSpec(
                name=names.grad(_group_name(t.name)),
                nbytes=t.nbytes // WEIGHT_BYTES_PER_PARAM * grad_bytes_per_param,
            )
            for t in rank_tensors(scn, pp)
            if names.is_model(t.name)
        ]
        full = [t for t in rank_tensors(scn, pp) if _group_name(t.name) in members]
        per_pp.append(tuple(record + full))
    return {
        g: StateLayout(rank=g, tensors=per_pp[topo.coords(g).pp], replicas=topo.replicas(g))
        for g in range(topo.world_size)
    }


def _group_name(tensor_name: str) -> str:
    """The tensor group of a preset tensor (presets hold parameters and optimizer state)."""
    group = names.group_of(tensor_name)
    if group is None:
        raise ValueError(f"{tensor_name!r} is neither a parameter nor optimizer state")
    return group


def bubbles_per_pp(scn: Scenario) -> tuple[tuple[float, ...], float]:
    """Idle seconds per iteration of each pipeline rank and the iteration seconds, from
    the simulator (no checkpoint work)."""
    topo = scn.topology
    base = simulate(
        scn.schedule, topo.num_pp, scn.num_microbatches, scn.times, num_virtual=scn.num_virtual
    )
    maps = base.bubble_maps()
    return tuple(maps[pp].capacity_s() for pp in range(topo.num_pp)), base.base_iteration_s


def _sends(scn: Scenario, red: Redundancy, per_pp: Sequence[int]) -> dict[int, int]:
    """Bytes each global rank sends per iteration when each holds ``per_pp[pp]`` bytes."""
    topo = scn.topology
    out = dict.fromkeys(range(topo.world_size), 0)
    if red.kind == "none":
        return out
    shards = {r: per_pp[topo.coords(r).pp] for r in range(topo.world_size)}
    seen: set[int] = set()
    for layout in group_layouts(topo, red, shards).values():
        if id(layout) in seen:
            continue
        seen.add(id(layout))
        for t in layout.transfers():
            out[t.src_rank] += t.nbytes
    return out


def _held(scn: Scenario, red: Redundancy, per_pp: Sequence[int]) -> dict[int, int]:
    """Redundancy bytes (replicas, parity) each global rank holds for its group."""
    topo = scn.topology
    if red.kind == "none":
        return dict.fromkeys(range(topo.world_size), 0)
    shards = {r: per_pp[topo.coords(r).pp] for r in range(topo.world_size)}
    layouts = group_layouts(topo, red, shards)
    return {r: layouts[r].redundancy_nbytes(r) for r in range(topo.world_size)}


def model_differential(
    scn: Scenario,
    idle_s: Sequence[float],
    *,
    iteration_s: float,
    redundancy: str = "xor:2",
    grad_bytes_per_param: int = GRAD_BYTES_PER_PARAM,
    full_every: int | None = None,
    max_k: int = 64,
) -> DifferentialModel:
    """Bytes and seconds per GPU and iteration of full vs differential checkpoints.

    ``idle_s[pp]``: idle seconds per iteration of pipeline rank ``pp`` (``bubbles_per_pp``).
    ``full_every``: a fixed ``K``; ``None`` chooses it per rank with ``choose_full_every``
    (capacity = the bytes that rank's bubbles can copy and send) and takes the largest.
    Raises ``ValueError`` for a redundancy the topology cannot place.
    """
    topo, hw = scn.topology, scn.hardware
    if len(idle_s) != topo.num_pp:
        raise ValueError(f"idle_s has {len(idle_s)} entries for pp={topo.num_pp}")
    if iteration_s <= 0 or grad_bytes_per_param <= 0:
        raise ValueError("iteration_s and grad_bytes_per_param must be > 0")
    red = Redundancy.parse(redundancy)
    if red.kind != "none":
        coding_groups(topo, red)  # raises ValueError with the fix
    dp = topo.num_dp
    groups, records = [], []
    for pp in range(topo.num_pp):
        g, params = tensor_groups(scn, pp)
        groups.append(g)
        records.append(params * grad_bytes_per_param)
    state = [sum(x.nbytes for x in g) for g in groups]
    full = [-(-s // dp) for s in state]
    full_sent = _sends(scn, red, full)
    full_held = _held(scn, red, full)
    ranks_of = {
        pp: [r for r in range(topo.world_size) if topo.coords(r).pp == pp]
        for pp in range(topo.num_pp)
    }
    # bytes a GPU's bubbles can protect: idle / (seconds per protected byte), where a
    # protected byte costs its D2H copy plus the redundancy it makes the NIC send
    send_per_byte = [
        max(full_sent[r] for r in ranks_of[pp]) / max(full[pp], 1) for pp in range(topo.num_pp)
    ]
    chosen = []
    for pp in range(topo.num_pp):
        # per-GPU units: every byte of the stage's record and slices is split over dp
        capacity = idle_s[pp] / (1.0 / hw.d2h_Bps + send_per_byte[pp] / hw.nic_Bps)
        sizes = [-(-x.nbytes // dp) for x in groups[pp]]
        chosen.append(choose_full_every(-(-records[pp] // dp), sizes, capacity, max_k))
    if full_every is None:
        # the rank needing the largest k; among those, the one with the least idle
        deciding = max(range(topo.num_pp), key=lambda pp: (chosen[pp][0], -idle_s[pp], -pp))
        k, reason = chosen[deciding][0], f"pp={deciding}: {chosen[deciding][1]}"
    else:
        if full_every < 1:
            raise ValueError(f"full_every must be >= 1, got {full_every}")
        k, reason = full_every, f"full_every={full_every} as given"
    slices = [
        slice_nbytes(groups[pp], assign_slices(groups[pp], k), k) for pp in range(topo.num_pp)
    ]
    diff = [-(-payload_nbytes(records[pp], slices[pp]) // dp) for pp in range(topo.num_pp)]
    diff_sent = _sends(scn, red, diff)
    retained = [
        -(-retained_nbytes(records[pp], slices[pp], padded=True) // dp) for pp in range(topo.num_pp)
    ]
    diff_held = _held(scn, red, retained)  # the store's payloads, protected like snapshots
    rows = []
    for pp in range(topo.num_pp):
        ranks = ranks_of[pp]
        fs, ds = max(full_sent[r] for r in ranks), max(diff_sent[r] for r in ranks)
        rows.append(
            RankBytes(
                pp=pp,
                idle_s=idle_s[pp],
                state_nbytes=state[pp],
                record_nbytes=records[pp],
                slice_nbytes=max(slices[pp]),
                full_every=chosen[pp][0],
                reason=chosen[pp][1],
                full_nbytes=full[pp],
                diff_nbytes=diff[pp],
                full_send_nbytes=fs,
                diff_send_nbytes=ds,
                full_s=full[pp] / hw.d2h_Bps + fs / hw.nic_Bps,
                diff_s=diff[pp] / hw.d2h_Bps + ds / hw.nic_Bps,
                full_store_nbytes=2 * (full[pp] + max(full_held[r] for r in ranks)),
                diff_store_nbytes=retained[pp] + max(diff_held[r] for r in ranks),
            )
        )
    record = max(records)
    replay_s = (k - 1) * (
        record * (dp - 1) / dp / hw.nic_Bps + record / hw.d2h_Bps + scn.times.optimizer_s
    )
    return DifferentialModel(
        full_every=k,
        reason=reason,
        fits=all(r.diff_s <= r.idle_s for r in rows),
        full_fits=all(r.full_s <= r.idle_s for r in rows),
        iteration_s=iteration_s,
        rows=tuple(rows),
        nic_Bps=hw.nic_Bps,
        d2h_Bps=hw.d2h_Bps,
        redundancy=str(red),
        grad_bytes_per_param=grad_bytes_per_param,
        replay_steps=k - 1,
        replay_s=replay_s,
    )


def to_dict(model: DifferentialModel) -> dict[str, Any]:
    """JSON-ready form (``baft simulate --json``; ``summary_lines`` renders it)."""
    worst = {
        f: model.worst(f)
        for f in (
            "full_nbytes",
            "diff_nbytes",
            "record_nbytes",
            "slice_nbytes",
            "full_send_nbytes",
            "diff_send_nbytes",
            "full_s",
            "diff_s",
            "full_store_nbytes",
            "diff_store_nbytes",
        )
    }
    return {
        "full_every": model.full_every,
        "reason": model.reason,
        "fits": model.fits,
        "full_fits": model.full_fits,
        "iteration_s": model.iteration_s,
        "redundancy": model.redundancy,
        "grad_bytes_per_param": model.grad_bytes_per_param,
        "replay_steps": model.replay_steps,
        "replay_s": model.replay_s,
        "least_idle_s": min(r.idle_s for r in model.rows),
        "nic_full_fraction": worst["full_send_nbytes"] / model.nic_Bps / model.iteration_s,
        "nic_diff_fraction": worst["diff_send_nbytes"] / model.nic_Bps / model.iteration_s,
        "worst_per_gpu": worst,
        "per_pp": [
            {k: getattr(r, k) for k in RankBytes.__slots__}  # type: ignore[attr-defined]
            for r in model.rows
        ],
    }


def _gb(n: float) -> str:
    return f"{n / 1e9:.3f} GB"


def _diff_line(d: dict[str, Any]) -> str:
    w = d["worst_per_gpu"]
    if d["full_every"] == 1:
        if d["full_fits"]:
            return "  differential:  not needed, full snapshots fit every iteration (full_every=1)"
        return "  differential:  no full_every copies less than the whole state (full_every=1)"
    return (
        f"  differential:  copy {_gb(w['diff_nbytes'])} (record {_gb(w['record_nbytes'])} + "
        f"slice {_gb(w['slice_nbytes'])} of the stage, /dp), NIC sends "
        f"{_gb(w['diff_send_nbytes'])} ({d['nic_diff_fraction']:.1%}), "
        f"{w['diff_s'] * 1e3:.1f} ms: " + ("fits" if d["fits"] else "does not fit")
    )


def summary_lines(d: dict[str, Any]) -> list[str]:
    """Human-readable rows for ``baft simulate`` from ``to_dict``'s dict (worst GPU)."""
    w = d["worst_per_gpu"]
    return [
        f"differential checkpoints (full_every={d['full_every']}, redundancy "
        f"{d['redundancy']}, grads {d['grad_bytes_per_param']} B/param), worst GPU per "
        "iteration:",
        f"  full snapshot: copy {_gb(w['full_nbytes'])}, NIC sends {_gb(w['full_send_nbytes'])} "
        f"({d['nic_full_fraction']:.1%} of the iteration), {w['full_s'] * 1e3:.1f} ms vs least "
        f"idle {d['least_idle_s'] * 1e3:.1f} ms: " + ("fits" if d["full_fits"] else "does not fit"),
        _diff_line(d),
        f"  host store per GPU: full {_gb(w['full_store_nbytes'])}, differential "
        f"{_gb(w['diff_store_nbytes'])}; recovery replays <= {d['replay_steps']} steps "
        f"(+{d['replay_s'] * 1e3:.0f} ms)",
        f"  K: {d['reason']}",
    ]
