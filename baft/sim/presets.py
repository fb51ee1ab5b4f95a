"""Pure presets for cluster-scale what-ifs: models, accelerators, and the derived scenario.

Model shapes are the published ones; hardware numbers are vendor peaks with the
derating stated next to each. ``build_scenario`` turns (model, hardware, GPU count,
parallel layout) into per-stage F/B seconds (6 * params * tokens: F = 1/3, B = 2/3),
p2p seconds (activation bytes / NIC), the exposed DP all-reduce (ring, last gradient
bucket only) and the checkpoint state per rank (2 bytes bf16 weights + 12 bytes fp32
master, Adam m and v per parameter), plus ``StateLayout`` per global rank.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from baft.plan import names
from baft.plan.types import StateLayout, TensorSpec
from baft.sim.schedules import SCHEDULES, num_stages, stage_rank
from baft.sim.simulator import StageTimes
from baft.topology import Topology

__all__ = ["HARDWARE", "MODELS", "Hardware", "ModelPreset", "Scenario", "build_scenario"]

BYTES_PER_PARAM = 14
"""bf16 weight (2) + fp32 master weight, Adam exp_avg and exp_avg_sq (4 + 4 + 4)."""
OPTIMIZER_BYTES_PER_PARAM = 28
"""HBM traffic of one Adam step per parameter: read grad, master, m, v; write them and
the bf16 weight (2 + 12 read + 12 written + 2)."""
P2P_LATENCY_S = 10e-6
"""Per-message latency added to every pipeline transfer."""


@dataclass(frozen=True, slots=True)
class ModelPreset:
    """Shape of a decoder-only transformer and its usual training layout."""

    name: str
    """Preset name, e.g. "llama2-34b"."""
    num_layers: int
    """Transformer blocks."""
    hidden: int
    """Model width."""
    num_heads: int
    """Attention heads."""
    num_kv_heads: int
    """Key/value heads (grouped-query attention when fewer than ``num_heads``)."""
    ffn_hidden: int
    """MLP inner width."""
    vocab: int
    """Vocabulary size."""
    seq_len: int
    """Training sequence length."""
    gated_mlp: bool
    """SwiGLU (3 matrices, Llama) or GELU (2 matrices, GPT-3)."""
    tied_embeddings: bool
    """GPT-3 ties input and output embeddings (the last stage still stores a copy)."""
    global_batch_tokens: int
    """Published global batch in tokens."""
    default_tp: int
    """Tensor-parallel degree used when --tp is not given."""
    default_pp: int
    """Pipeline degree used when --pp is not given."""
    source: str
    """Where the shape comes from."""

    def layer_params(self) -> int:
        h = self.hidden
        kv = h * self.num_kv_heads // self.num_heads
        attn = h * (h + 2 * kv) + h * h
        mlp = (3 if self.gated_mlp else 2) * h * self.ffn_hidden
        if self.gated_mlp:
            return attn + mlp + 2 * h  # two RMSNorm weights, no biases
        return attn + mlp + (h + 2 * kv) + h + self.ffn_hidden + h + 4 * h  # biases, 2 LayerNorms

    def embedding_params(self) -> int:
        pos = 0 if self.gated_mlp else self.seq_len * self.hidden  # learned positions (GPT-3)
        return self.vocab * self.hidden + pos

    def head_params(self) -> int:
        return self.vocab * self.hidden

    def num_params(self) -> int:
        """Parameter count (tied head counted once)."""
        head = 0 if self.tied_embeddings else self.head_params()
        return self.num_layers * self.layer_params() + self.embedding_params() + head + self.hidden


MODELS: dict[str, ModelPreset] = {
    m.name: m
    for m in (
        ModelPreset(
            name="llama2-7b",
            num_layers=32,
            hidden=4096,
            num_heads=32,
            num_kv_heads=32,
            ffn_hidden=11008,
            vocab=32000,
            seq_len=4096,
            gated_mlp=True,
            tied_embeddings=False,
            global_batch_tokens=4 << 20,
            default_tp=2,
            default_pp=4,
            source="Llama 2 paper (Touvron et al. 2023), Table 1 / HF config: 6.74B",
        ),
        ModelPreset(
            name="llama2-13b",
            num_layers=40,
            hidden=5120,
            num_heads=40,
            num_kv_heads=40,
            ffn_hidden=13824,
            vocab=32000,
            seq_len=4096,
            gated_mlp=True,
            tied_embeddings=False,
            global_batch_tokens=4 << 20,
            default_tp=4,
            default_pp=4,
            source="Llama 2 paper, Table 1 / HF config: 13.0B",
        ),
        ModelPreset(
            name="llama2-34b",
            num_layers=48,
            hidden=8192,
            num_heads=64,
            num_kv_heads=8,
            ffn_hidden=22016,
            vocab=32000,
            seq_len=4096,
            gated_mlp=True,
            tied_embeddings=False,
            global_batch_tokens=4 << 20,
            default_tp=8,
            default_pp=4,
            source="Llama 2 paper, Table 1 (34B, GQA); shape as Code Llama 34B: 33.7B",
        ),
        ModelPreset(
            name="llama2-70b",
            num_layers=80,
            hidden=8192,
            num_heads=64,
            num_kv_heads=8,
            ffn_hidden=28672,
            vocab=32000,
            seq_len=4096,
            gated_mlp=True,
            tied_embeddings=False,
            global_batch_tokens=4 << 20,
            default_tp=8,
            default_pp=8,
            source="Llama 2 paper, Table 1 / HF config: 69.0B",
        ),
        ModelPreset(
            name="gpt3-175b",
            num_layers=96,
            hidden=12288,
            num_heads=96,
            num_kv_heads=96,
            ffn_hidden=49152,
            vocab=50257,
            seq_len=2048,
            gated_mlp=False,
            tied_embeddings=True,
            global_batch_tokens=3_200_000,
            default_tp=8,
            default_pp=16,
            source="GPT-3 paper (Brown et al. 2020), Table 2.1: 175B, batch 3.2M tokens",
        ),
    )
}


@dataclass(frozen=True, slots=True)
class Hardware:
    """One accelerator (as torch sees it) and its share of the node."""

    name: str
    """Preset name, e.g. "h100"."""
    peak_bf16_flops: float
    """Dense bf16 tensor FLOP/s (vendor peak)."""
    mfu: float
    """Assumed share of peak reached inside a stage's F/B (bubbles excluded)."""
    hbm_bytes: float
    """Device memory in bytes."""
    hbm_Bps: float
    """Device memory bandwidth."""
    d2h_Bps: float
    """Sustained device -> pinned host copy per GPU while every GPU of the node copies."""
    nic_Bps: float
    """Sustained inter-node bandwidth per GPU."""
    host_memcpy_Bps: float
    """Host memory copy bandwidth per GPU (the node's DRAM bandwidth shared)."""
    gpus_per_node: int
    """Devices sharing one host (a failure domain)."""
    source: str
    """Vendor documents behind the numbers."""


HARDWARE: dict[str, Hardware] = {
    # NVIDIA A100 SXM4 80GB datasheet: 312 TFLOPS bf16 dense, HBM2e 80 GB at 2,039 GB/s,
    # PCIe Gen4 x16 (32 GB/s per direction). DGX A100: two GPUs per PCIe switch share one
    # Gen4 x16 uplink (16 GB/s each, 80% achievable -> 12.8 GB/s); 8x 200 Gb/s HDR HCAs
    # (25 GB/s per GPU, 80% -> 20 GB/s); 2x EPYC 7742 with 8x DDR4-3200 each (409.6 GB/s per
    # node, /8 GPUs, 50% for copies -> 25.6 GB/s). MFU: Megatron-LM (Narayanan et al. 2021)
    # reached 52% of peak end to end, bubbles included.
    "a100": Hardware(
        name="a100",
        peak_bf16_flops=312e12,
        mfu=0.55,
        hbm_bytes=80e9,
        hbm_Bps=2.039e12,
        d2h_Bps=12.8e9,
        nic_Bps=20e9,
        host_memcpy_Bps=25.6e9,
        gpus_per_node=8,
        source="NVIDIA A100 datasheet; DGX A100 user guide",
    ),
    # NVIDIA H100 SXM5 80GB datasheet: 989 TFLOPS bf16 dense (1,979 with sparsity), HBM3
    # 80 GB at 3.35 TB/s, PCIe Gen5 x16 (64 GB/s per direction). DGX H100: assume two GPUs
    # share a Gen5 x16 path to the CPU (32 GB/s each, 80% -> 25.6 GB/s); 8x ConnectX-7
    # 400 Gb/s NDR (50 GB/s per GPU, 80% -> 40 GB/s); 2x Xeon 8480C with 8x DDR5-4800 each
    # (614 GB/s per node, /8, 50% -> 38.4 GB/s). MFU: Llama 3 (2024) reports 38-43% end to
    # end on 16K H100s; 50% inside a stage is the optimistic side (shorter bubbles).
    "h100": Hardware(
        name="h100",
        peak_bf16_flops=989e12,
        mfu=0.5,
        hbm_bytes=80e9,
        hbm_Bps=3.35e12,
        d2h_Bps=25.6e9,
        nic_Bps=40e9,
        host_memcpy_Bps=38.4e9,
        gpus_per_node=8,
        source="NVIDIA H100 datasheet; DGX H100 user guide",
    ),
    # AMD Instinct MI250X (per GCD, one torch device; two per OAM): 383 TFLOPS bf16 per OAM
    # -> 191.5 per GCD; 128 GB HBM2e at 3.28 TB/s per OAM -> 64 GB, 1.64 TB/s per GCD.
    # Frontier node (OLCF user guide): 36 GB/s Infinity Fabric CPU-GPU per GCD (80% ->
    # 28.8 GB/s); 4x Slingshot 200 Gb/s per node, one per OAM (12.5 GB/s per GCD, 80% ->
    # 10 GB/s); one EPYC 7A53 with 8x DDR4-3200 (204.8 GB/s per node, /8, 50% -> 12.8 GB/s).
    "mi250x": Hardware(
        name="mi250x",
        peak_bf16_flops=191.5e12,
        mfu=0.4,
        hbm_bytes=64e9,
        hbm_Bps=1.6384e12,
        d2h_Bps=28.8e9,
        nic_Bps=10e9,
        host_memcpy_Bps=12.8e9,
        gpus_per_node=8,
        source="AMD MI250X datasheet; OLCF Frontier user guide",
    ),
}


@dataclass(frozen=True, slots=True)
class Scenario:
    """A model on a cluster with a parallel layout, and what follows from it."""

    model: ModelPreset
    hardware: Hardware
    topology: Topology
    schedule: str
    num_virtual: int
    num_microbatches: int
    micro_batch_size: int
    global_batch_tokens: int
    """Effective global batch (may differ from the preset's after rounding)."""
    times: StageTimes
    stage_layers: tuple[tuple[int, ...], ...]
    """Layer indices per stage."""
    rank_stages: tuple[tuple[int, ...], ...]
    """Stages held by each pipeline rank."""
    state_bytes: tuple[int, ...]
    """Checkpoint state per pipeline rank (one TP shard, whole DP replica group)."""
    notes: tuple[str, ...]

    def shard_bytes(self, pp: int) -> int:
        """Bytes one DP replica snapshots when the group splits evenly."""
        return -(-self.state_bytes[pp] // self.topology.num_dp)


def _layer_tensors(model: ModelPreset, layer: int) -> list[tuple[str, int]]:
    h = model.hidden
    kv = h * model.num_kv_heads // model.num_heads
    f = model.ffn_hidden
    pre = f"layers.{layer}"
    if model.gated_mlp:
        return [
            (f"{pre}.attention.wq.weight", h * h),
            (f"{pre}.attention.wk.weight", h * kv),
            (f"{pre}.attention.wv.weight", h * kv),
            (f"{pre}.attention.wo.weight", h * h),
            (f"{pre}.feed_forward.w1.weight", h * f),
            (f"{pre}.feed_forward.w2.weight", f * h),
            (f"{pre}.feed_forward.w3.weight", h * f),
            (f"{pre}.attention_norm.weight", h),
            (f"{pre}.ffn_norm.weight", h),
        ]
    return [
        (f"{pre}.attn.qkv.weight", h * (h + 2 * kv)),
        (f"{pre}.attn.qkv.bias", h + 2 * kv),
        (f"{pre}.attn.proj.weight", h * h),
        (f"{pre}.attn.proj.bias", h),
        (f"{pre}.mlp.fc1.weight", h * f),
        (f"{pre}.mlp.fc1.bias", f),
        (f"{pre}.mlp.fc2.weight", f * h),
        (f"{pre}.mlp.fc2.bias", h),
        (f"{pre}.ln1.weight_and_bias", 2 * h),
        (f"{pre}.ln2.weight_and_bias", 2 * h),
    ]


def _stage_tensors(
    model: ModelPreset, stage: int, num_stages_total: int, layers: tuple[int, ...]
) -> list[tuple[str, int]]:
    out: list[tuple[str, int]] = []
    if stage == 0:
        out.append(("tok_embeddings.weight", model.vocab * model.hidden))
        if not model.gated_mlp:
            out.append(("pos_embeddings.weight", model.seq_len * model.hidden))
    for layer in layers:
        out += _layer_tensors(model, layer)
    if stage == num_stages_total - 1:
        out.append(("norm.weight", model.hidden))
        out.append(("output.weight", model.head_params()))
    return out


def rank_tensors(scn: Scenario, pp: int) -> tuple[TensorSpec, ...]:
    """Checkpointed tensors of one TP shard of pipeline rank ``pp`` (canonical order:
    bf16 model weights, then fp32 master, exp_avg, exp_avg_sq per weight)."""
    tp = scn.topology.num_tp
    total = len(scn.stage_layers)
    named = [
        (name, -(-n // tp))
        for s in scn.rank_stages[pp]
        for name, n in _stage_tensors(scn.model, s, total, scn.stage_layers[s])
    ]
    model = [TensorSpec(name=names.model(name), nbytes=2 * n) for name, n in named]
    optim = [
        TensorSpec(name=names.optim(name, part), nbytes=4 * n)
        for name, n in named
        for part in ("master", "exp_avg", "exp_avg_sq")
    ]
    return tuple(model + optim)


def layouts(scn: Scenario) -> dict[int, StateLayout]:
    """StateLayout of every global rank (tensor tuples shared per pipeline rank)."""
    topo = scn.topology
    per_pp = [rank_tensors(scn, pp) for pp in range(topo.num_pp)]
    return {
        g: StateLayout(rank=g, tensors=per_pp[topo.coords(g).pp], replicas=topo.replicas(g))
        for g in range(topo.world_size)
    }


def _resolve_layout(
    model: ModelPreset, hw: Hardware, gpus: int, dp: int | None, pp: int | None, tp: int | None
) -> tuple[int, int, int]:
    tp = tp or model.default_tp
    pp = pp or model.default_pp
    if dp is None:
        if gpus % (tp * pp):
            raise ValueError(
                f"--gpus {gpus} is not a multiple of tp*pp = {tp}*{pp}: pick --gpus as a "
                f"multiple of {tp * pp} or set --tp/--pp"
            )
        dp = gpus // (tp * pp)
    if dp * pp * tp != gpus:
        raise ValueError(f"dp*pp*tp = {dp}*{pp}*{tp} = {dp * pp * tp} != --gpus {gpus}")
    if tp > hw.gpus_per_node or hw.gpus_per_node % tp:
        raise ValueError(f"tp={tp} must divide the {hw.gpus_per_node} GPUs of a {hw.name} node")
    return dp, pp, tp


def _microbatches(
    model: ModelPreset, schedule: str, pp: int, dp: int, mbs: int, given: int | None
) -> tuple[int, list[str]]:
    """Microbatches per iteration from the preset's global batch (or ``given``)."""
    if given is not None:
        return given, []
    notes = []
    m = max(1, model.global_batch_tokens // model.seq_len // (dp * mbs))
    if schedule != "zbv" and m < pp:
        notes.append(f"global batch raised so that microbatches ({pp}) >= pp")
        m = pp
    if schedule == "interleaved-1f1b" and m > pp and m % pp:
        m -= m % pp
    return m, notes


def _stage_times(
    model: ModelPreset,
    hw: Hardware,
    topo: Topology,
    mbs: int,
    stage_layers: tuple[tuple[int, ...], ...],
    rank_stages: tuple[tuple[int, ...], ...],
) -> StageTimes:
    """F/B from 6 * params * tokens, p2p from activation bytes, exposed DP all-reduce."""
    dp, pp, tp = topo.num_dp, topo.num_pp, topo.num_tp
    total = len(stage_layers)
    tokens_mb = mbs * model.seq_len
    speed = hw.peak_bf16_flops * hw.mfu
    fwd = []
    for s, layers in enumerate(stage_layers):
        matmul = len(layers) * model.layer_params() + (model.head_params() if s == total - 1 else 0)
        fwd.append(2.0 * matmul * tokens_mb / tp / speed)
    rank_params = [
        sum(n for s in stages for _, n in _stage_tensors(model, s, total, stage_layers[s])) / tp
        for stages in rank_stages
    ]
    layers_per_rank = sum(len(stage_layers[s]) for s in rank_stages[0])
    ring = 2.0 * (dp - 1) / dp * 2.0 * max(rank_params) / hw.nic_Bps if dp > 1 else 0.0
    act_bytes = mbs * model.seq_len * model.hidden * 2 / tp
    return StageTimes(
        forward_s=tuple(fwd),
        backward_s=tuple(2.0 * f for f in fwd),
        weight_fraction=0.5,
        p2p_s=act_bytes / hw.nic_Bps + P2P_LATENCY_S if pp > 1 else 0.0,
        dp_allreduce_s=ring / layers_per_rank,
        optimizer_s=OPTIMIZER_BYTES_PER_PARAM * max(rank_params) / hw.hbm_Bps,
        p2p_contention=2.0,
    )


def build_scenario(
    model_name: str,
    hardware_name: str,
    gpus: int,
    *,
    dp: int | None = None,
    pp: int | None = None,
    tp: int | None = None,
    num_microbatches: int | None = None,
    micro_batch_size: int = 1,
    schedule: str = "1f1b",
    num_virtual: int = 1,
    mfu: float | None = None,
) -> Scenario:
    """Derive a Scenario; raises ``ValueError`` with the fix for impossible layouts."""
    if model_name not in MODELS:
        raise ValueError(f"unknown preset {model_name!r}: use one of {', '.join(MODELS)}")
    if hardware_name not in HARDWARE:
        raise ValueError(f"unknown hardware {hardware_name!r}: use one of {', '.join(HARDWARE)}")
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}: use one of {', '.join(SCHEDULES)}")
    model, hw = MODELS[model_name], HARDWARE[hardware_name]
    if mfu is not None:
        hw = dataclasses.replace(hw, mfu=mfu)
    dp, pp, tp = _resolve_layout(model, hw, gpus, dp, pp, tp)
    v = 2 if schedule == "zbv" else num_virtual
    total = num_stages(schedule, pp, v)
    if model.num_layers % total:
        raise ValueError(
            f"{model.num_layers} layers do not split evenly over {total} stages "
            f"(pp={pp} x {v} per rank): pick --pp (and --virtual) dividing {model.num_layers}"
        )
    m, notes = _microbatches(model, schedule, pp, dp, micro_batch_size, num_microbatches)
    per = model.num_layers // total
    stage_layers = tuple(tuple(range(s * per, (s + 1) * per)) for s in range(total))
    owner = stage_rank(schedule, pp, v)
    rank_stages = tuple(tuple(s for s in range(total) if owner[s] == r) for r in range(pp))
    topo = Topology(num_pp=pp, num_dp=dp, num_tp=tp, ranks_per_node=min(hw.gpus_per_node, gpus))
    scn = Scenario(
        model=model,
        hardware=hw,
        topology=topo,
        schedule=schedule,
        num_virtual=v,
        num_microbatches=m,
        micro_batch_size=micro_batch_size,
        global_batch_tokens=m * dp * micro_batch_size * model.seq_len,
        times=_stage_times(model, hw, topo, micro_batch_size, stage_layers, rank_stages),
        stage_layers=stage_layers,
        rank_stages=rank_stages,
        state_bytes=(),
        notes=(),
    )
    state = tuple(sum(t.nbytes for t in rank_tensors(scn, r)) for r in range(pp))
    if max(state) > 0.8 * hw.hbm_bytes:
        notes.append(
            f"{max(state) / 1e9:.1f} GB of weights + optimizer state per GPU exceeds 80% of "
            f"HBM ({hw.hbm_bytes / 1e9:.0f} GB): this layout needs optimizer sharding, not modelled"
        )
    return dataclasses.replace(scn, state_bytes=state, notes=tuple(notes))
