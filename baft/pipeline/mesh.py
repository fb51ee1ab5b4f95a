"""Process-group and DeviceMesh set-up for a (pp, dp, tp) layout, on CPU/gloo or CUDA/NCCL."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from baft.topology import Coords, Topology


def pick_device() -> torch.device:
    """CUDA (one device per local rank) when present, else CPU."""
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


@dataclass
class Mesh:
    """This rank's view of the mesh: coordinates, sub-meshes and process groups."""

    rank: int
    topology: Topology
    coords: Coords
    device: torch.device
    mesh: DeviceMesh
    pp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    tp_mesh: DeviceMesh


class MeshDims(Protocol):
    """The mesh sizes :func:`init_mesh` needs (e.g. the reference app's ParallelConfig)."""

    num_pp: int
    num_dp: int
    num_tp: int
    ranks_per_node: int

    @property
    def world_size(self) -> int: ...


def init_mesh(parallel: MeshDims, timeout_s: float = 120.0) -> Mesh:
    """Initialise the default process group (from torchrun's env) and the job's mesh.

    Without FSDP2 (``num_dp_shard``, read when ``parallel`` has it, is 1): baft's own
    ``("pp", "dp", "tp")`` mesh. With it: torchtitan's ``("pp", "dp_replicate",
    "dp_shard", "tp")`` mesh, viewed through :func:`mesh_from_user` as a user's mesh is
    (``dp_replicate`` = replicas, ``dp_shard`` x ``tp`` = baft's shard axis); the
    returned :attr:`Mesh.mesh` is then torchtitan's mesh (what the app shards over and
    hands to ``baft.protect``), the groups and coordinates baft's view of it."""
    device = pick_device()
    if not dist.is_initialized():
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    world = dist.get_world_size()
    dp_shard = int(getattr(parallel, "num_dp_shard", 1))
    if world != parallel.world_size:
        raise ValueError(
            f"world size {world} != dp*dp_shard*pp*tp = {parallel.world_size}; launch with "
            f"--nproc-per-node {parallel.world_size}"
        )
    if dp_shard > 1:
        titan = init_device_mesh(
            device.type,
            (parallel.num_pp, parallel.num_dp, dp_shard, parallel.num_tp),
            mesh_dim_names=("pp", "dp_replicate", "dp_shard", "tp"),
        )
        view, _ = mesh_from_user(titan, parallel.ranks_per_node, device)
        return replace(view, mesh=titan)
    topo = Topology(
        num_pp=parallel.num_pp,
        num_dp=parallel.num_dp,
        num_tp=parallel.num_tp,
        ranks_per_node=parallel.ranks_per_node,
    )
    mesh = init_device_mesh(
        device.type,
        (parallel.num_pp, parallel.num_dp, parallel.num_tp),
        mesh_dim_names=("pp", "dp", "tp"),
    )
    return mesh_view(mesh, topo, device)


def mesh_view(mesh: DeviceMesh, topo: Topology, device: torch.device) -> Mesh:
    """This rank's :class:`Mesh` over a (pp, dp, tp) DeviceMesh."""
    rank = dist.get_rank()
    return Mesh(
        rank=rank,
        topology=topo,
        coords=topo.coords(rank),
        device=device,
        mesh=mesh,
        pp_group=mesh["pp"].get_group(),
        dp_group=mesh["dp"].get_group(),
        tp_mesh=mesh["tp"],
    )


REPLICA_DIMS = ("dp_replicate", "dp")
"""Mesh dims whose ranks hold identical bytes (replicas): torchtitan's ``dp_replicate``
(HSDP's replicate dim, or plain DP), or ``dp``, baft's older name for it."""
SHARD_DIMS = ("dp_shard", "fsdp", "cp", "tp")
"""Mesh dims whose ranks hold different pieces: FSDP2's ``dp_shard`` (``fsdp`` in
torchtitan's newer meshes, which fold ``dp_shard`` x ``cp`` into it), context parallel
``cp`` (refused when > 1) and ``tp``. baft folds them, in this order, into one shard axis."""
MESH_DIMS = ("pp", *REPLICA_DIMS, *SHARD_DIMS)
"""Every dim name :func:`mesh_from_user` understands (torchtitan's, plus ``dp``)."""


def _canonical_ranks(device_mesh: DeviceMesh) -> tuple[torch.Tensor, dict[str, int]]:
    """The mesh's ranks ordered ``(pp, replicas, dp_shard, cp, tp)`` (absent dims size 1)
    and the size of every named dim; ValueError for names baft does not know."""
    names = tuple(device_mesh.mesh_dim_names or ())
    shape = tuple(device_mesh.mesh.shape)
    if len(names) != len(shape) or len(set(names)) != len(names):
        raise ValueError(f"device_mesh needs one distinct name per dim, got {names or None}")
    unknown = [n for n in names if n not in MESH_DIMS]
    if unknown:
        raise ValueError(
            f"device_mesh dim(s) {unknown} unknown: baft understands {', '.join(MESH_DIMS)} "
            "(torchtitan's names; 'dp' is another name for dp_replicate: replicas)"
        )
    for a, b in (("dp", "dp_replicate"), ("dp_shard", "fsdp")):
        if a in names and b in names:
            raise ValueError(f"device_mesh has both {a!r} and {b!r}: they name the same dim")
    sizes = dict(zip(names, shape, strict=True))
    if sizes.get("cp", 1) > 1:
        raise ValueError(
            f"context parallel (device_mesh dim 'cp' of size {sizes['cp']}) is not supported: "
            "its ranks hold pieces of the activations baft does not checkpoint"
        )
    order = ["pp", "dp_replicate" if "dp_replicate" in names else "dp", *SHARD_DIMS]
    ranks = device_mesh.mesh
    for n in order:  # absent dims become trailing size-1 dims, then everything is permuted
        if n not in names:
            ranks = ranks.unsqueeze(-1)
    full = [*names, *(n for n in order if n not in names)]
    return ranks.permute([full.index(n) for n in order]).contiguous(), sizes


def mesh_from_user(
    device_mesh: DeviceMesh, ranks_per_node: int, device: torch.device
) -> tuple[Mesh, DeviceMesh | None]:
    """baft's (pp, dp, tp) view of the user's mesh, whatever subset of
    :data:`MESH_DIMS` it names, in any order: ``dp`` = the replica dim, ``tp`` = the
    shard axis (``dp_shard`` x ``cp`` x ``tp`` flattened, so a rank's shard identity
    covers all three coordinates). Also the mesh baft made for it (its groups are baft's
    to end), or None when the user's mesh already is ``("pp", "dp", "tp")``.

    The ranks must be numbered pipeline-major (pp, then replicas, then shards), as
    ``init_device_mesh`` numbers torchtitan's ``("pp", "dp_replicate", "dp_shard", "cp",
    "tp")``; baft's failure domains are blocks of consecutive ranks. Collective when it
    makes a mesh (every rank calls it)."""
    ranks, sizes = _canonical_ranks(device_mesh)
    world = dist.get_world_size()
    num_pp, num_dp = ranks.shape[0], ranks.shape[1]
    num_tp = ranks.numel() // (num_pp * num_dp)
    if ranks.numel() != world or not torch.equal(ranks.reshape(-1), torch.arange(world)):
        raise ValueError(
            f"device_mesh {dict(sizes)} must cover ranks 0..{world - 1} numbered pp-major "
            "(pp, then dp_replicate, then dp_shard, cp, tp), as init_device_mesh numbers "
            "mesh_dim_names=('pp', 'dp_replicate', 'dp_shard', 'cp', 'tp'); got ranks "
            f"{device_mesh.mesh.tolist()}"
        )
    topo = Topology(num_pp=num_pp, num_dp=num_dp, num_tp=num_tp, ranks_per_node=ranks_per_node)
    if tuple(device_mesh.mesh_dim_names or ()) == ("pp", "dp", "tp"):
        return mesh_view(device_mesh, topo, device), None
    own = DeviceMesh(
        device.type, ranks.reshape(num_pp, num_dp, num_tp), mesh_dim_names=("pp", "dp", "tp")
    )
    return mesh_view(own, topo, device), own
