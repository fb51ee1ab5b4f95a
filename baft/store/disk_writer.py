"""The DCP writer process: ``python -m baft.store.disk_writer FD`` (started by
:class:`baft.store.disk_process.ProcessPersister`, one per rank).

It runs ``dcp.save`` off the training process: its own interpreter (a fresh one, not a
fork), at idle CPU priority, in a gloo group of every rank's writer that meets through the
job's c10d store under a prefix the ranks agreed on. It reads the tensors straight from the
shared-memory files the training process's tensors live in (the committed store slot, the
differential live copy): each request names every tensor by file, inode, offset, dtype
and shape (:func:`describe`); what lives in no shared file comes pickled. The checkpoint
is written, committed and pruned by a :class:`~baft.store.disk.Persister` in this process
(same keys, ``baft_meta.json``, ``.complete`` marker and ``latest`` as the thread writer).

It exits when its parent dies (``PR_SET_PDEATHSIG``, and a thread polling the parent's
pid for the case the spawning thread was not the main one): a half-written checkpoint is
never marked complete, since the marker is written after every rank's writer finished.

The wire format is plain tuples over a ``multiprocessing.connection.Connection``:
``("save", version, entries, metadata, layouts)`` -> ``("done", version, "")`` or
``("error", version, text)``; ``("stop",)`` ends it.
"""

from __future__ import annotations

import bisect
import ctypes
import mmap
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

PR_SET_PDEATHSIG = 1


# ------------------------------------------------------------------ the parent's side
@dataclass(frozen=True, slots=True)
class Mapping_:
    """One file mapping of this process (a line of ``/proc/self/maps``)."""

    start: int
    end: int
    offset: int
    inode: int
    path: str


def file_mappings() -> list[Mapping_]:
    """This process's mappings of regular files, by start address."""
    out: list[Mapping_] = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) < 6 or not fields[5].startswith("/"):
                continue
            path = fields[5].rstrip("\n")
            if path.endswith(" (deleted)") or "s" not in fields[1]:
                continue  # replaced, or a private mapping: the child could not see it
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            out.append(Mapping_(lo, hi, int(fields[2], 16), int(fields[4]), path))
    out.sort(key=lambda m: m.start)
    return out


def locate(ptr: int, nbytes: int, maps: list[Mapping_]) -> tuple[str, int, int] | None:
    """``(path, inode, file offset)`` of the bytes ``[ptr, ptr + nbytes)`` when one shared
    file mapping holds them all, else None."""
    i = bisect.bisect_right([m.start for m in maps], ptr) - 1
    if i < 0 or nbytes <= 0:
        return None
    m = maps[i]
    if ptr + nbytes > m.end:
        return None
    return m.path, m.inode, m.offset + (ptr - m.start)


def describe(state: dict[str, Any]) -> tuple[list[tuple[Any, ...]], int]:
    """The request's entries for ``state`` and how many bytes go pickled: a contiguous
    tensor in a shared file is ``("map", key, path, inode, offset, dtype, shape)``,
    anything else ``("value", key, value)``."""
    import torch

    maps = file_mappings()
    starts = [m.start for m in maps]
    entries: list[tuple[Any, ...]] = []
    inline = 0
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.is_contiguous() and value.device.type == "cpu":
            n = value.numel() * value.element_size()
            ptr = value.data_ptr()
            i = bisect.bisect_right(starts, ptr) - 1
            where = locate(ptr, n, maps[i : i + 1]) if i >= 0 else None
            if where is not None:
                entries.append(("map", key, *where, value.dtype, tuple(value.shape)))
                continue
            inline += n
        entries.append(("value", key, value))
    return entries, inline


def describe_layouts(
    layouts: Any, state: dict[str, Any]
) -> tuple[dict[str, tuple[Any, ...]], dict[str, Any]]:
    """DTensor layouts (DCP key -> :class:`~baft.store.dcp_state.ShardLayout`, and every
    DTensor of ``state``) as plain data: the mesh's global ranks and dim names,
    placements, global shape and stride; and ``state`` with DTensors as their local
    tensors."""
    from torch.distributed.tensor import DTensor

    out = {}
    for key, g in layouts.items():
        out[key] = (
            g.mesh.mesh.tolist(), g.mesh.mesh_dim_names, tuple(g.placements),
            tuple(g.shape), tuple(g.stride),
        )  # fmt: skip
    plain = dict(state)
    for key, t in state.items():
        if isinstance(t, DTensor):
            out[key] = (
                t.device_mesh.mesh.tolist(), t.device_mesh.mesh_dim_names,
                tuple(t.placements), tuple(t.shape), tuple(t.stride()),
            )  # fmt: skip
            plain[key] = t.to_local()
    return out, plain


# ------------------------------------------------------------------ the child's side
def guard_parent(parent: int) -> None:
    """Exit when ``parent`` dies: the kernel's parent-death signal, and a poll of the
    parent pid (the signal follows the spawning *thread*, and misses a parent that died
    before it was set)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        os._exit(3)

    def poll() -> None:
        while True:
            if os.getppid() != parent:
                os._exit(3)
            time.sleep(0.2)

    threading.Thread(target=poll, name="baft-writer-parent", daemon=True).start()


def lower_priority() -> None:
    """Idle CPU priority for this process (and every thread it starts later)."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (OSError, AttributeError):
        try:
            os.nice(19)
        except OSError:
            pass


class _Files:
    """The shared files one request reads, mapped for that request alone (a store may
    resize or replace a slot file between saves)."""

    def __init__(self) -> None:
        self.maps: dict[str, tuple[mmap.mmap, Any]] = {}

    def view(self, path: str, inode: int, offset: int, dtype: Any, shape: tuple[int, ...]) -> Any:
        import torch

        if path not in self.maps:
            fd = os.open(path, os.O_RDWR)
            try:
                st = os.fstat(fd)
                if st.st_ino != inode:
                    raise RuntimeError(f"{path} was replaced since the save was requested")
                mm = mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
            self.maps[path] = (mm, torch.frombuffer(mm, dtype=torch.uint8))
        raw = self.maps[path][1]
        n = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        piece = raw[offset : offset + n]
        if offset % piece.new_empty((), dtype=dtype).element_size():
            piece = piece.clone()  # misaligned for the dtype: read through a copy
        return piece.view(dtype).view(shape)

    def close(self) -> None:
        maps, self.maps = self.maps, {}
        for mm, raw in maps.values():
            del raw
            try:
                mm.close()
            except BufferError:  # a view still alive: the mapping goes with it
                pass


class _Meshes:
    """DeviceMeshes over this process's writer group, one per mesh the parent used (no
    sub-groups: DCP needs only each rank's coordinate and the placements)."""

    def __init__(self) -> None:
        self.cache: dict[Any, Any] = {}

    def dtensor(self, local: Any, desc: tuple[Any, ...]) -> Any:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import DTensor

        ranks, dim_names, placements, shape, stride = desc
        key = (repr(ranks), tuple(dim_names or ()))
        if key not in self.cache:
            self.cache[key] = DeviceMesh(
                "cpu", ranks, mesh_dim_names=tuple(dim_names) if dim_names else None,
                _init_backend=False,
            )  # fmt: skip
        return DTensor.from_local(
            local, self.cache[key], placements, run_check=False,
            shape=torch_size(shape), stride=tuple(stride),
        )  # fmt: skip


def torch_size(shape: Any) -> Any:
    import torch

    return torch.Size(shape)


def serve(conn: Any, cfg: dict[str, Any]) -> None:
    """Join the writers' group, then answer save requests until told to stop."""
    import torch
    import torch.distributed as dist

    from baft.store.disk import Persister, _Job

    torch.set_num_threads(1)
    distributed = cfg["world"] > 1 or cfg["host"] is not None
    if distributed:
        from datetime import timedelta

        timeout = timedelta(seconds=cfg["timeout_s"])
        tcp = dist.TCPStore(cfg["host"], cfg["port"], is_master=False, timeout=timeout)
        dist.init_process_group(
            "gloo", store=dist.PrefixStore(cfg["prefix"], tcp), rank=cfg["rank"],
            world_size=cfg["world"], timeout=timeout,
        )  # fmt: skip
    persister = Persister(
        cfg["directory"], keep_latest=cfg["keep_latest"], rank=cfg["rank"],
        timeout_s=cfg["timeout_s"],
    )  # fmt: skip
    meshes = _Meshes()
    conn.send(("ready", 0, ""))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg[0] == "stop":
            conn.send(("stopped", 0, ""))
            return
        _, version, entries, metadata, layouts = msg
        files = _Files()
        try:
            state: dict[str, Any] = {}
            for entry in entries:
                if entry[0] == "map":
                    local = files.view(*entry[2:])
                else:
                    local = entry[2]
                desc = layouts.get(entry[1])
                state[entry[1]] = local if desc is None else meshes.dtensor(local, desc)
            job = _Job(version=version, state=state, metadata=metadata, future=None)  # type: ignore[arg-type]
            persister._save(job)
            reply = ("done", version, "")
        except Exception as e:  # noqa: BLE001 - reported to the training process
            reply = ("error", version, f"{type(e).__name__}: {e}")
        finally:
            state = {}
            files.close()
        conn.send(reply)


def main(argv: list[str]) -> None:
    from multiprocessing.connection import Connection

    conn = Connection(int(argv[1]))
    cfg = conn.recv()
    guard_parent(cfg["parent"])
    if cfg["idle"]:
        lower_priority()
    try:
        serve(conn, cfg)
    except Exception as e:  # noqa: BLE001 - told to the parent, then exit
        try:
            conn.send(("failed", -1, f"{type(e).__name__}: {e}"))
        except OSError:
            pass
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no interpreter teardown under gloo's threads


if __name__ == "__main__":
    main(sys.argv)
