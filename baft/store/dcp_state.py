"""A flat training state as DCP sees it, and loading a version of the disk tier into one.

baft snapshots rank-local bytes; DCP must see tensor-parallel shards as the DTensors they
belong to (:class:`ShardLayout`, :func:`as_dtensors`), and it clones any tensor whose
storage is larger than the tensor unless the view is re-wrapped first
(:func:`compact_state`). Non-tensor values must be plain data (:data:`PLAIN_VALUES`).
:func:`load_version` loads a complete version in place, after checking every key's
shape and dtype against the checkpoint's metadata.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed import ProcessGroup
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

from baft.store.disk_layout import list_versions, read_metadata, version_dir


class ShardLayout(Protocol):
    """Where a rank-local tensor sits in its DTensor (a TP shard): what the disk tier
    needs to save and load it as that DTensor. :class:`baft.pipeline.layout.GlobalLayout`
    is one."""

    @property
    def mesh(self) -> Any: ...
    @property
    def placements(self) -> tuple[Any, ...]: ...
    @property
    def shape(self) -> torch.Size: ...
    @property
    def stride(self) -> tuple[int, ...]: ...


def as_dtensors(
    state: Mapping[str, torch.Tensor], layouts: Mapping[str, ShardLayout]
) -> dict[str, torch.Tensor]:
    """``state`` with every plain tensor named in ``layouts`` wrapped, without a copy or a
    collective, as the DTensor whose local shard it is. baft snapshots rank-local bytes;
    DCP must see TP shards as DTensors, else the shards of one tensor are same-named
    plain tensors and DCP keeps one of them (every other TP rank restores its bytes)."""
    out: dict[str, torch.Tensor] = {}
    for key, t in state.items():
        g = layouts.get(key)
        out[key] = (
            t
            if g is None or isinstance(t, DTensor)
            else DTensor.from_local(
                t, g.mesh, g.placements, run_check=False, shape=g.shape, stride=g.stride
            )
        )
    return out


def load_version(
    directory: str | Path,
    version: int,
    state: dict[str, torch.Tensor],
    process_group: ProcessGroup | None = None,
    layouts: Mapping[str, ShardLayout] | None = None,
) -> dict[str, Any]:
    """Load complete checkpoint ``version`` in place into ``state``; return its metadata.

    ``layouts``: keys whose rank-local tensors are DTensor shards, loaded as those
    DTensors (see :attr:`Persister.layouts`).

    Plain ``dcp.load``: without an initialized default group it loads in this process
    alone; otherwise it is collective over ``process_group`` (default: the world).
    """
    complete = list_versions(directory)
    if version not in complete:
        raise ValueError(
            f"version {version} is not a complete checkpoint in {directory}; "
            f"pick one of {complete} (see latest_version())"
        )
    wanted = as_dtensors(state, layouts or {})
    check_against_metadata(wanted, directory, version)
    no_dist = not (dist.is_available() and dist.is_initialized())
    dcp.load(
        wanted,
        storage_reader=FileSystemReader(version_dir(directory, version)),
        process_group=process_group,
        no_dist=no_dist,
    )
    return read_metadata(directory, version)


def check_against_metadata(
    state: Mapping[str, torch.Tensor], directory: str | Path, version: int
) -> None:
    """Raise ValueError naming every key of ``state`` that checkpoint ``version`` lacks or
    holds with another global shape or dtype (DTensors by their global shape); before a
    byte is read. DCP itself refuses a missing key or another size, but would convert
    another dtype silently; this names all of them at once."""
    saved = FileSystemReader(version_dir(directory, version)).read_metadata()
    problems: list[str] = []
    for key, t in state.items():
        md = saved.state_dict_metadata.get(key)
        if md is None:
            problems.append(f"{key} (absent)")
            continue
        size, props = getattr(md, "size", None), getattr(md, "properties", None)
        if size is None or props is None:
            problems.append(f"{key} (saved as an object, not a tensor)")
        elif tuple(size) != tuple(t.shape) or props.dtype != t.dtype:
            problems.append(
                f"{key} (saved {props.dtype}{list(size)}, now {t.dtype}{list(t.shape)})"
            )
    if problems:
        shown = "; ".join(problems[:8]) + (" ..." if len(problems) > 8 else "")
        raise ValueError(
            f"{version_dir(directory, version)} does not hold this job's tensors "
            f"({len(problems)} differ): {shown}; nothing was loaded"
        )


def compact_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The same memory as ``tensor`` behind a storage of exactly its size, if possible.

    DCP's writer clones any CPU tensor whose storage is larger than the tensor (so
    ``torch.save`` does not write the whole snapshot buffer); a zero-copy re-wrap of
    the view avoids that copy. Anything else is returned unchanged.
    """
    if (
        tensor.device.type != "cpu"
        or not tensor.is_contiguous()
        or tensor.numel() == 0
        or tensor.untyped_storage().nbytes() == tensor.nbytes
    ):
        return tensor
    carrier = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(
        tensor.element_size()
    )
    if carrier is None or tensor.is_complex() or tensor.is_quantized:
        return tensor
    try:
        raw = tensor.detach().view(carrier).numpy()
    except (RuntimeError, TypeError):  # e.g. a lazy negation view; DCP will clone
        return tensor
    return torch.from_numpy(raw).view(tensor.dtype)


def compact_state(state: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for fqn, value in state.items():
        if isinstance(value, DTensor):
            local = value.to_local()
            compact = compact_tensor(local)
            out[fqn] = (
                value
                if compact is local
                else DTensor.from_local(
                    compact,
                    value.device_mesh,
                    value.placements,
                    run_check=False,
                    shape=value.shape,
                    stride=value.stride(),
                )
            )
        elif isinstance(value, torch.Tensor):
            out[fqn] = compact_tensor(value)
        else:  # a plain value (optimizer.param_groups.*): DCP pickles it
            out[fqn] = value
    return out


def nested_by_head(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with its keys grouped by their first dotted part (``optimizer.x.y`` under
    ``optimizer`` as ``x.y``): the same checkpoint, key for key, since DCP flattens a
    nested dict by joining its path with dots, and a flat ``dcp.load`` reads it. Why:
    ``dcp.save`` wraps every top-level key in its method logger (``_stateful_to_state_dict``
    builds a message and two debug records per key), 0.2 ms each; a job's 1,279 keys
    (torch's flattened ``param_groups``: one per parameter and hyperparameter) cost 0.15-0.3
    s of the writer's CPU per save here, a few keys cost nothing. A key equal to another's
    first part stays flat (both cannot nest)."""
    heads = {k.partition(".")[0] for k in state if "." in k}
    out: dict[str, Any] = {}
    for key, value in state.items():
        head, dot, rest = key.partition(".")
        if dot and rest and head in heads and head not in state:
            out.setdefault(head, {})[rest] = value
        else:
            out[key] = value
    return out


class SavePlanner(DefaultSavePlanner):
    """DCP's default save planner, serializing each distinct plain value once per save.

    DCP writes a plain value (a ``BYTE_IO`` item) as ``torch.save`` of it, the format its
    loader reads. torch's flattened ``param_groups`` repeat each group's hyperparameters
    for every parameter (935 items, about a dozen distinct values, in the bench's job):
    one ``torch.save`` each cost 0.15-0.2 s of the writer's CPU per save here. The bytes
    written are the same. Plain values (:data:`PLAIN_VALUES`, tuples and lists of them)
    are told apart by type and ``repr``, which is exact for them (floats round-trip)."""

    def __init__(self) -> None:
        super().__init__()
        self._saved: dict[tuple[type, str], bytes] = {}

    def transform_object(self, write_item: WriteItem, object: Any) -> Any:  # noqa: A002 - DCP's name
        if write_item.type != WriteItemType.BYTE_IO:
            return super().transform_object(write_item, object)
        key = (type(object), repr(object))
        raw = self._saved.get(key)
        if raw is None:
            buf = io.BytesIO()
            torch.save(object, buf)
            raw = self._saved[key] = buf.getvalue()
        return io.BytesIO(raw)


PLAIN_VALUES = (bool, int, float, str, type(None))
"""Non-tensor values a checkpoint may hold (also inside tuples and lists)."""


def is_plain(value: Any) -> bool:
    if isinstance(value, (torch.Tensor, *PLAIN_VALUES)):
        return True
    return isinstance(value, (tuple, list)) and all(is_plain(v) for v in value)
