"""Presets: published parameter counts, derived times and layouts, layout validation."""

from __future__ import annotations

import pytest

from baft.sim.presets import HARDWARE, MODELS, build_scenario, layouts, rank_tensors


@pytest.mark.parametrize(
    ("name", "billions"),
    [
        ("llama2-7b", 6.74),
        ("llama2-13b", 13.0),
        ("llama2-34b", 33.7),
        ("llama2-70b", 69.0),
        ("gpt3-175b", 175.0),
    ],
)
def test_parameter_counts_match_published(name: str, billions: float) -> None:
    assert MODELS[name].num_params() / 1e9 == pytest.approx(billions, rel=0.005)


def test_llama2_34b_on_512_h100() -> None:
    scn = build_scenario("llama2-34b", "h100", 512)
    topo = scn.topology
    assert (topo.num_dp, topo.num_pp, topo.num_tp, topo.ranks_per_node) == (16, 4, 8, 8)
    assert scn.num_microbatches == 64 and scn.global_batch_tokens == 64 * 16 * 4096
    hw, m = HARDWARE["h100"], MODELS["llama2-34b"]
    layer_fwd = 2.0 * m.layer_params() * 4096 / 8 / (hw.peak_bf16_flops * hw.mfu)
    fwd = scn.times.forward_s
    assert isinstance(fwd, tuple)
    assert fwd[0] == pytest.approx(12 * layer_fwd, rel=1e-12)
    assert fwd[3] > fwd[0]  # the last stage also runs the LM head
    assert scn.times.backward_s == tuple(2 * f for f in fwd)
    assert scn.times.p2p_s == pytest.approx(4096 * 8192 * 2 / 8 / hw.nic_Bps + 10e-6)
    # state: 14 bytes per parameter of the TP shard
    stage0 = (12 * m.layer_params() + m.vocab * m.hidden) / 8 * 14
    assert scn.state_bytes[0] == pytest.approx(stage0, rel=1e-6)
    assert sum(t.nbytes for t in rank_tensors(scn, 0)) == scn.state_bytes[0]


def test_layouts_share_tensors_within_a_stage() -> None:
    scn = build_scenario("llama2-7b", "a100", 32, pp=4, tp=2)
    lays = layouts(scn)
    topo = scn.topology
    assert len(lays) == 32
    g = topo.rank_of(1, 2, 1)
    assert lays[g].replicas == topo.replicas(g)
    assert lays[g].tensors is lays[topo.rank_of(1, 0, 0)].tensors
    names = [t.name for t in lays[g].tensors]
    assert names[0] == "model.layers.8.attention.wq.weight"
    assert names[-1] == "optim.layers.15.ffn_norm.weight.exp_avg_sq"


def test_zbv_and_interleaved_stage_placement() -> None:
    scn = build_scenario("llama2-34b", "h100", 512, schedule="zbv")
    assert scn.num_virtual == 2 and scn.rank_stages[0] == (0, 7) and scn.rank_stages[3] == (3, 4)
    inter = build_scenario("llama2-34b", "h100", 512, schedule="interleaved-1f1b", num_virtual=3)
    assert inter.rank_stages[1] == (1, 5, 9)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"model_name": "llama9", "hardware_name": "h100", "gpus": 8}, "unknown preset"),
        ({"model_name": "llama2-34b", "hardware_name": "tpu", "gpus": 8}, "unknown hardware"),
        (
            {"model_name": "llama2-34b", "hardware_name": "h100", "gpus": 100},
            "not a multiple of tp",
        ),
        (
            {
                "model_name": "llama2-34b",
                "hardware_name": "h100",
                "gpus": 512,
                "pp": 5,
                "tp": 8,
                "dp": 4,
            },
            "!= --gpus",
        ),
        (
            {"model_name": "llama2-34b", "hardware_name": "h100", "gpus": 320, "pp": 5},
            "do not split evenly",
        ),
        (
            {"model_name": "llama2-34b", "hardware_name": "h100", "gpus": 512, "tp": 16, "pp": 2},
            "must divide the 8",
        ),
    ],
)
def test_layout_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build_scenario(**kwargs)


def test_small_batch_raises_microbatches_to_pp() -> None:
    scn = build_scenario("llama2-70b", "h100", 8192, pp=8, tp=8)  # dp 128 -> 8 seqs each
    assert scn.num_microbatches == 8
    scn = build_scenario("llama2-7b", "h100", 4096, pp=4, tp=2)  # dp 512 -> 2 seqs each
    assert scn.num_microbatches == 4 and "raised" in scn.notes[0]
