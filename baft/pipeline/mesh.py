"""Process-group and DeviceMesh set-up for a (pp, dp, tp) layout, on CPU/gloo or CUDA/NCCL."""

from __future__ import annotations

import os
from dataclasses import dataclass
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
    """Initialise the default process group (from torchrun's env) and the (pp, dp, tp) mesh."""
    device = pick_device()
    if not dist.is_initialized():
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    world = dist.get_world_size()
    if world != parallel.world_size:
        raise ValueError(
            f"world size {world} != dp*pp*tp = {parallel.world_size}; launch with "
            f"--nproc-per-node {parallel.world_size}"
        )
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
