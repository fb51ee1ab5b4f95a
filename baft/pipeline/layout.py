"""Shard identity of checkpointed tensors, and the guard against sharded "replicas".

baft's ``dp`` axis (the user's ``dp_replicate``, or ``dp``) means *replicas*: ranks
holding identical bytes, which split the snapshot work and whose gradients may be
averaged. Sharded data parallelism (FSDP2 over ``dp_shard``) and TP are baft's shard axis:
every rank checkpoints its own local pieces. A DTensor sharded over the replica dim holds
a different piece on every replica; restoring it as a replica builds each rank from two
ranks' bytes. So:

* :func:`check_no_sharded_replicas` refuses, before the first step, any parameter or
  optimizer state whose placements shard over the ranks baft treats as DP replicas (and
  any ``fully_shard`` module doing so), naming the tensor, the dim and the fix;
* :func:`placement_of` gives a tensor's identity beyond its bytes (global shape,
  placements over named mesh dims, local offset in the global tensor), which
  :class:`~baft.pipeline.state.TrainingState` puts into its layout digest;
* :func:`check_replica_layouts` compares the layouts of the DP ranks of each ``(pp, tp)``
  and names the first tensor whose identity differs;
* :func:`detect_mesh`, :func:`fsdp_reduces_over` and :func:`check_fsdp_supported` read
  the stages' FSDP2 set-up: the job's mesh when none is given, whether HSDP averages the
  replicas' gradients itself, and what baft refuses (CPU offload, shards along dim > 0).

Only this module reads DTensor and FSDP internals (``pipeline/`` is the torch adapter).
Nothing here does I/O or talks to a process group.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

__all__ = [
    "FSDP_HELP",
    "GlobalLayout",
    "check_no_sharded_replicas",
    "check_replica_layouts",
    "check_fsdp_supported",
    "detect_mesh",
    "fsdp_reduces_over",
    "first_difference",
    "placement_of",
]

FSDP_HELP = (
    "baft treats the mesh dim 'dp_replicate' (or 'dp') as replicas (identical bytes on "
    "every rank along it); shard over a dim named 'dp_shard' instead (fully_shard(mesh="
    "mesh['dp_shard']), or mesh['dp_replicate', 'dp_shard'] for HSDP) and pass that mesh "
    "as baft.protect(device_mesh=...)"
)


def _dim_name(mesh: Any, dim: int) -> str:
    names = mesh.mesh_dim_names
    return names[dim] if names else f"mesh dim {dim}"


def _ranks_along(mesh: Any, dim: int) -> set[int]:
    """The global ranks of ``mesh`` along ``dim`` through this rank's coordinate."""
    coord = mesh.get_coordinate()
    if coord is None:  # this rank is not in the mesh
        return set()
    index = tuple(slice(None) if i == dim else c for i, c in enumerate(coord))
    return {int(r) for r in mesh.mesh[index].reshape(-1).tolist()}


def _sharded_dim(t: Any, dp_ranks: set[int]) -> str | None:
    """The mesh dim over which DTensor ``t`` is not replicated and which spans more than
    one of ``dp_ranks`` (this rank's DP replicas); None if there is none."""
    if not isinstance(t, DTensor):
        return None
    mesh = t.device_mesh
    for dim, placement in enumerate(t.placements):
        if isinstance(placement, Replicate):
            continue
        if len(_ranks_along(mesh, dim) & dp_ranks) > 1:
            return f"{_dim_name(mesh, dim)!r} ({placement!r})"
    return None


def _fsdp_sharded_dims(module: nn.Module, dp_ranks: set[int]) -> list[tuple[str, str]]:
    """(submodule fqn, mesh dim) of every ``fully_shard`` module of ``module`` whose
    shard dim spans more than one of ``dp_ranks``."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return []
    out = []
    for fqn, sub in module.named_modules():
        if not isinstance(sub, FSDPModule):
            continue
        try:
            groups = sub._get_fsdp_state()._fsdp_param_groups
            infos = [g.mesh_info for g in groups]
        except (AssertionError, AttributeError):  # internals moved: the params still tell
            continue
        for info in infos:
            dim = getattr(info, "shard_mesh_dim", None)
            if dim is not None and len(_ranks_along(info.mesh, dim) & dp_ranks) > 1:
                out.append((fqn or "<stage module>", _dim_name(info.mesh, dim)))
    return out


def check_no_sharded_replicas(
    modules: Sequence[nn.Module], optimizer: torch.optim.Optimizer, dp_ranks: Iterable[int]
) -> None:
    """Raise ValueError unless every parameter, buffer and optimizer state of ``modules``
    is replicated over ``dp_ranks`` (the global ranks baft treats as this rank's DP
    replicas, itself included). Call it before anything is hooked or allocated."""
    dp = set(dp_ranks)
    if len(dp) < 2:
        return
    for i, m in enumerate(modules):
        fsdp = _fsdp_sharded_dims(m, dp)
        if fsdp:
            fqn, dim = fsdp[0]
            raise ValueError(
                f"stage module {i} ({type(m).__name__}): {fqn} is fully_shard-ed over mesh "
                f"dim {dim!r}, which spans ranks {sorted(dp)} that baft's device_mesh "
                f"calls 'dp'; {FSDP_HELP}"
            )
    names = {id(p): fqn for m in modules for fqn, p in m.named_parameters()}
    tensors: list[tuple[str, Any]] = [
        (f"parameter {fqn}", p) for m in modules for fqn, p in m.named_parameters()
    ]
    tensors += [(f"buffer {fqn}", b) for m in modules for fqn, b in m.named_buffers()]
    for g in optimizer.param_groups:
        for p in g["params"]:
            for key, v in optimizer.state.get(p, {}).items():
                tensors.append((f"optimizer state {names.get(id(p), '?')}.{key}", v))
    for what, t in tensors:
        sharded = _sharded_dim(t, dp)
        if sharded is not None:
            raise ValueError(
                f"{what} is a DTensor sharded over mesh dim {sharded}, which spans ranks "
                f"{sorted(dp)} that baft's device_mesh calls 'dp'; {FSDP_HELP}"
            )


class GlobalLayout(NamedTuple):
    """Where a rank-local tensor sits in its DTensor (a TP shard, say)."""

    mesh: Any
    """The DTensor's DeviceMesh."""
    placements: tuple[Any, ...]
    shape: torch.Size
    """The global shape."""
    stride: tuple[int, ...]
    """The global stride."""


def placement_of(t: torch.Tensor) -> tuple[tuple[int, ...], str, tuple[int, ...]]:
    """``(global shape, placements, local offset)`` of a (possibly DTensor) tensor.

    Placements name their mesh dims (``"tp:Shard(dim=0)"``), never rank numbers (a
    restarted job may renumber its ranks); a plain tensor is its own global tensor
    (no placements, offset zero)."""
    if not isinstance(t, DTensor):
        return tuple(t.shape), "", (0,) * t.dim()
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh = t.device_mesh
    shape = tuple(t.shape)
    _, offset = compute_local_shape_and_global_offset(shape, mesh, t.placements)
    placements = ",".join(f"{_dim_name(mesh, d)}:{p!r}" for d, p in enumerate(t.placements))
    return shape, placements, tuple(int(x) for x in offset)


def first_difference(a: Sequence[Any], b: Sequence[Any]) -> str | None:
    """The first tensor whose identity differs between layouts ``a`` and ``b`` (lists of
    :class:`~baft.pipeline.state.TensorInfo`), described; None if they are equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            if x.name != y.name:
                return f"tensor #{i} is {x.name} on one rank, {y.name} on the other"
            fields = [
                f"{f} {getattr(x, f)} vs {getattr(y, f)}"
                for f in ("dtype", "global_shape", "placements", "shape", "offset", "nbytes")
                if getattr(x, f) != getattr(y, f)
            ]
            return f"{x.name}: {', '.join(fields)}"
    if len(a) != len(b):
        longer = a if len(a) > len(b) else b
        return f"{longer[min(len(a), len(b))].name}: present on one rank only"
    return None


def check_replica_layouts(gathered: Iterable[tuple[tuple[int, int, int], Sequence[Any]]]) -> None:
    """Raise ValueError unless the DP ranks of every ``(pp, tp)`` hold the same layout.

    ``gathered``: ``((pp, dp, tp), layout)`` of ranks (each layout a list of
    :class:`~baft.pipeline.state.TensorInfo`). The message names the first differing
    tensor: ranks that differ in it hold different pieces, not replicas."""
    first: dict[tuple[int, int], tuple[int, Sequence[Any]]] = {}
    for (pp, dp, tp), layout in sorted(gathered, key=lambda g: g[0]):
        dp0, ref = first.setdefault((pp, tp), (dp, layout))
        diff = first_difference(ref, layout)
        if diff is not None:
            raise ValueError(
                f"DP ranks dp{dp0} and dp{dp} of pp{pp}.tp{tp} are not replicas: {diff}. "
                f"{FSDP_HELP}"
            )


def detect_mesh(modules: Sequence[nn.Module], world_size: int) -> Any | None:
    """The DeviceMesh the stages' DTensor parameters (FSDP2, TP) were laid out on, when
    ``protect`` got no ``device_mesh``: the root mesh of the first DTensor parameter, if
    it spans the whole job; None without DTensor parameters. ValueError when the
    parameters' meshes cover only part of the job (the pipeline dim is not in them):
    then baft cannot tell which ranks are replicas, and the user must say it."""
    for m in modules:
        for fqn, p in m.named_parameters():
            if not isinstance(p, DTensor):
                continue
            mesh = p.device_mesh
            get_root = getattr(mesh, "_get_root_mesh", None)  # private: absent, use the mesh
            root = get_root() if get_root is not None else mesh
            if root.mesh.numel() == world_size and root.mesh_dim_names:
                return root
            raise ValueError(
                f"parameter {fqn} is a DTensor on mesh {root.mesh_dim_names or '(unnamed)'} "
                f"of {root.mesh.numel()} ranks, not the job's {world_size}: pass the job's "
                "mesh as baft.protect(device_mesh=...) with dims named pp, dp_replicate, "
                "dp_shard, tp (the ones you use)"
            )
    return None


def uses_fsdp(modules: Sequence[nn.Module]) -> bool:
    """Whether any of ``modules`` has a ``fully_shard`` submodule (FSDP2)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return False
    return any(isinstance(sub, FSDPModule) for m in modules for sub in m.modules())


def fsdp_reduces_over(modules: Sequence[nn.Module], ranks: Iterable[int]) -> bool:
    """True when every ``fully_shard`` module of ``modules`` reduces its gradients over all
    of ``ranks`` (HSDP: FSDP2 all-reduces over its replicate dim): then the replicas'
    gradients are averaged already and baft must not average them again."""
    want = set(ranks)
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return False
    found = False
    for m in modules:
        for sub in m.modules():
            if not isinstance(sub, FSDPModule):
                continue
            try:
                infos = [g.mesh_info for g in sub._get_fsdp_state()._fsdp_param_groups]
            except (AssertionError, AttributeError):
                return False
            for info in infos:
                dim = getattr(info, "replicate_mesh_dim", None)
                if dim is None or not want <= _ranks_along(info.mesh, dim):
                    return False
                found = True
    return found


def check_fsdp_supported(modules: Sequence[nn.Module]) -> None:
    """Raise ValueError, before anything is hooked, for what FSDP2 can do and baft cannot
    restore correctly yet: CPU offload (the sharded parameters and optimizer state live
    in host memory that FSDP2 moves, not on the device baft copies from) and shards
    along a dim other than 0 (``shard_placement_fn``): baft's layouts, differential
    records and DCP keys assume FSDP2's default dim-0 shards."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return
    for i, m in enumerate(modules):
        fqns = {id(p): fqn for fqn, p in m.named_parameters()}
        for fqn, sub in m.named_modules():
            if not isinstance(sub, FSDPModule):
                continue
            try:
                groups = sub._get_fsdp_state()._fsdp_param_groups
            except (AssertionError, AttributeError):  # internals moved: nothing to check
                continue
            where = f"stage module {i} ({type(m).__name__}): {fqn or '<stage module>'}"
            for g in groups:
                for fp in g.fsdp_params:
                    if getattr(fp, "offload_to_cpu", False):
                        raise ValueError(
                            f"{where} is fully_shard-ed with CPUOffloadPolicy, which baft "
                            "does not support yet: drop offload_policy (baft keeps its "
                            "snapshots in host memory already)"
                        )
                    placement = getattr(fp, "fsdp_placement", None)
                    if placement is not None and getattr(placement, "dim", 0) != 0:
                        name = fqns.get(id(fp.sharded_param), fp._module_info.param_name)
                        raise ValueError(
                            f"{where}: parameter {name} is sharded along dim "
                            f"{placement.dim} ({placement!r}, from shard_placement_fn); "
                            "baft supports FSDP2's default Shard(0) only"
                        )
