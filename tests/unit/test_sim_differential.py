"""Cluster-scale model of differential checkpoints: bytes, seconds and K per GPU."""

from __future__ import annotations

import json

import pytest

from baft.plan.rotation import assign_slices, payload_nbytes, retained_nbytes, slice_nbytes
from baft.plan.types import CheckpointPolicy
from baft.sim.command import evaluate
from baft.sim.differential import (
    GRAD_BYTES_PER_PARAM,
    bubbles_per_pp,
    model_differential,
    payload_layouts,
    summary_lines,
    tensor_groups,
    to_dict,
)
from baft.sim.presets import build_scenario, layouts, rank_tensors

# llama2-7b on 16 A100s: tp=2, pp=4, dp=2, two nodes; xor:2 pairs the GPUs with the same
# local index on the two nodes: pp 0 with pp 2, pp 1 with pp 3; each holds a parity
# block as large as the larger shard of the pair
SCN = build_scenario("llama2-7b", "a100", 16)
PARTNER = {0: 2, 1: 3, 2: 0, 3: 1}


def test_tensor_groups_hold_every_byte_and_the_record_counts_params() -> None:
    for pp in range(SCN.topology.num_pp):
        groups, params = tensor_groups(SCN, pp)
        tensors = rank_tensors(SCN, pp)
        assert sum(g.nbytes for g in groups) == sum(t.nbytes for t in tensors)
        weights = [t for t in tensors if t.name.startswith("model.")]
        assert len(groups) == len(weights)
        assert params == sum(t.nbytes for t in weights) // 2
        assert all(g.nbytes == 14 * n.nbytes // 2 for g, n in zip(groups, weights, strict=True))
    groups, _ = tensor_groups(SCN, 0)
    assert groups[0].name == "tok_embeddings.weight"


def _expected(pp: int, k: int, dp: int) -> tuple[int, int, int]:
    groups, params = tensor_groups(SCN, pp)
    record = params * GRAD_BYTES_PER_PARAM
    sizes = slice_nbytes(groups, assign_slices(groups, k), k)
    state = sum(g.nbytes for g in groups)
    return (
        -(-state // dp),
        -(-payload_nbytes(record, sizes) // dp),
        retained_nbytes(record, sizes, padded=True),
    )


def test_plenty_of_idle_keeps_full_snapshots() -> None:
    m = model_differential(SCN, [100.0] * 4, iteration_s=200.0)
    assert m.full_every == 1 and m.fits and m.full_fits and m.replay_steps == 0
    assert m.replay_s == 0.0
    for r in m.rows:
        full, diff, _ = _expected(r.pp, 1, 2)
        assert (r.full_nbytes, r.diff_nbytes) == (full, full)
        # xor:2 is (k=1, m=1): each GPU sends its whole shard to its partner on the other node
        assert r.full_send_nbytes == r.full_nbytes == r.diff_send_nbytes
        assert r.full_s == pytest.approx(full / 12.8e9 + full / 20e9)
        # double-buffered: its own shard and the parity it holds for the pair
        assert r.full_store_nbytes == 2 * (full + max(full, _expected(PARTNER[r.pp], 1, 2)[0]))
    assert "not needed" in summary_lines(to_dict(m))[2]


def test_tight_bubbles_choose_the_smallest_k_that_fits_on_every_rank() -> None:
    full, _, _ = _expected(0, 1, 2)
    per_byte = 1 / 12.8e9 + 1 / 20e9
    idle = 0.6 * full * per_byte  # full snapshots need 1.67x the idle time
    m = model_differential(SCN, [idle] * 4, iteration_s=10.0)
    assert not m.full_fits and m.fits
    k = m.full_every
    assert k > 1 and m.replay_steps == k - 1
    for r in m.rows:
        f, d, retained = _expected(r.pp, k, 2)
        assert (r.full_nbytes, r.diff_nbytes) == (f, d)
        assert r.diff_send_nbytes == d
        assert r.diff_s == pytest.approx(d * per_byte) and r.diff_s <= idle
        partner = _expected(PARTNER[r.pp], k, 2)[2]
        assert r.diff_store_nbytes == -(-retained // 2) + max(-(-retained // 2), -(-partner // 2))
        assert r.full_every <= k
    # the deciding rank needs exactly k: k - 1 does not fit there
    deciding = max(m.rows, key=lambda r: r.full_every)
    assert deciding.full_every == k
    _, d_prev, _ = _expected(deciding.pp, k - 1, 2)
    assert d_prev * per_byte > idle
    assert m.reason.startswith(f"pp={deciding.pp}: full_every={k}")
    lines = summary_lines(to_dict(m))
    assert "does not fit" in lines[1] and lines[2].endswith("fits")
    assert f"replays <= {k - 1} steps" in lines[3]


def test_nothing_fits_reports_the_least_bytes_and_spills() -> None:
    m = model_differential(SCN, [1e-4] * 4, iteration_s=10.0, max_k=8)
    assert not m.fits and not m.full_fits
    assert "spills" in m.reason
    # with a 4 B/param record the least bytes are at the largest k tried
    assert m.full_every == 8


def test_fixed_full_every_redundancy_none_and_bf16_grads() -> None:
    m = model_differential(
        SCN, [1.0] * 4, iteration_s=10.0, redundancy="none", full_every=3, grad_bytes_per_param=2
    )
    assert m.full_every == 3 and m.reason == "full_every=3 as given"
    groups, params = tensor_groups(SCN, 1)
    sizes = slice_nbytes(groups, assign_slices(groups, 3), 3)
    row = m.rows[1]
    assert row.record_nbytes == 2 * params and row.slice_nbytes == max(sizes)
    assert row.diff_nbytes == -(-(2 * params + max(sizes)) // 2)
    assert row.full_send_nbytes == row.diff_send_nbytes == 0
    assert row.full_store_nbytes == 2 * row.full_nbytes
    assert row.diff_store_nbytes == -(-retained_nbytes(2 * params, sizes, padded=True) // 2)
    d = to_dict(m)
    assert d["full_every"] == 3 and d["nic_diff_fraction"] == 0.0
    assert d["worst_per_gpu"]["diff_nbytes"] == max(r.diff_nbytes for r in m.rows)
    assert [p["pp"] for p in d["per_pp"]] == [0, 1, 2, 3]
    dp = SCN.topology.num_dp
    record = max(r.record_nbytes for r in m.rows)
    hw = SCN.hardware
    assert m.replay_s == pytest.approx(
        2 * (record * (dp - 1) / dp / hw.nic_Bps + record / hw.d2h_Bps + SCN.times.optimizer_s)
    )


def test_inputs_are_checked() -> None:
    with pytest.raises(ValueError, match="idle_s has 2 entries"):
        model_differential(SCN, [1.0, 1.0], iteration_s=1.0)
    with pytest.raises(ValueError, match="nodes"):
        model_differential(SCN, [1.0] * 4, iteration_s=1.0, redundancy="xor:3")
    with pytest.raises(ValueError, match=">= 1"):
        model_differential(SCN, [1.0] * 4, iteration_s=1.0, full_every=0)


def test_bubbles_from_the_simulator() -> None:
    idle, it = bubbles_per_pp(SCN)
    assert len(idle) == 4 and it > 0
    assert all(0 < x < it for x in idle)
    m = model_differential(SCN, idle, iteration_s=it)
    assert m.full_every >= 1 and len(summary_lines(to_dict(m))) == 5


def test_payload_layouts_hold_the_record_and_the_largest_slice() -> None:
    lays = payload_layouts(SCN, 3)
    assert set(lays) == set(range(SCN.topology.world_size))
    for rank, lay in lays.items():
        pp = SCN.topology.coords(rank).pp
        groups, params = tensor_groups(SCN, pp)
        sizes = slice_nbytes(groups, assign_slices(groups, 3), 3)
        assert lay.nbytes == params * GRAD_BYTES_PER_PARAM + max(sizes)
        assert lay.replicas == SCN.topology.replicas(rank)
        names = [t.name for t in lay.tensors]
        assert len(names) == len(set(names))
        assert sum(n.startswith("grad.") for n in names) == len(groups)
    assert payload_layouts(SCN, 1) == layouts(SCN)


@pytest.mark.timeout(120)
def test_simulate_reports_differential_next_to_full() -> None:
    scn = build_scenario("llama2-7b", "h100", 16)
    kw = {"mtbf_s": 6 * 3600.0, "storage_Bps": 0.5e9, "restart_s": 60.0}
    result = evaluate(scn, CheckpointPolicy(), **kw)
    d = result["differential"]
    assert d["full_every"] > 1 and d["replay_steps"] == d["full_every"] - 1
    assert not d["full_fits"]
    assert d["worst_per_gpu"]["diff_nbytes"] < d["worst_per_gpu"]["full_nbytes"]
    # planned and replayed on the simulator like the full snapshots: less exposed
    assert d["mode"]["exposed_s"] < result["modes"]["baft"]["exposed_s"]
    assert d["mode"]["full_every"] == d["full_every"]
    assert d["mode"]["replay_s"] == d["replay_s"] > 0
    lines = summary_lines(d)
    assert lines[0].startswith(f"differential checkpoints (full_every={d['full_every']}")
    json.dumps(result)  # JSON-ready
