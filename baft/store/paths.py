"""Where stores live: the host whose memory holds them, the directory tree and the file
names of a rank's store.

``{root}/{job_id}/node{node}/rank{rank}/`` holds ``slot{s}.data``, ``slot{s}.red``,
``slot{s}.json``, ``commit.json`` and ``progress`` (see :mod:`baft.store.shm`). Names
only: nothing here opens a slot file. :func:`host_id` names the machine (and boot)
whose memory a store root is in: ranks with equal ids read each other's stores.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path

PROGRESS_FILE = "progress"
"""One page: the version being written, its slot, how many shard bytes are final (layout
and protocol: :mod:`baft.store.progress`)."""
KINDS = ("data", "red")
"""The two files of a slot: the shard (``data``) and its redundancy area (``red``)."""
SLOT_FILE = re.compile(r"^slot(\d+)\.(?:data|red|json)$")


def host_id() -> str:
    """This machine in this boot: ranks with equal ids share host memory. ``BAFT_HOST_ID``
    overrides it (tests that play several hosts on one machine)."""
    override = os.environ.get("BAFT_HOST_ID")
    if override:
        return override
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def slot_file_name(slot: int, kind: str) -> str:
    """File name of a slot's ``data``/``red`` file or (``kind="json"``) its manifest."""
    if kind not in (*KINDS, "json"):
        raise ValueError(f"kind must be one of data, red, json; got {kind!r}")
    return f"slot{slot}.{kind}"


def job_path(root: Path, job_id: str) -> Path:
    """Directory of a job's stores under ``root``."""
    return Path(root) / job_id


def node_path(root: Path, job_id: str, node: int) -> Path:
    """Directory of one node's stores of a job."""
    return job_path(root, job_id) / f"node{node}"


def rank_path(root: Path, job_id: str, node: int, rank: int) -> Path:
    """Directory of one rank's store."""
    return node_path(root, job_id, node) / f"rank{rank}"


@dataclass(frozen=True, slots=True)
class StoreAddress:
    """Where one rank's store lives."""

    root: Path
    """Store root (parent of job directories)."""
    job_id: str
    """Job directory name."""
    node: int
    """Node number."""
    rank: int
    """Rank number."""


def job_stores(root: Path, job_id: str) -> list[StoreAddress]:
    """Every rank store of job ``job_id`` under the store root ``root`` (one scan)."""
    return [a for a in find_stores(job_path(root, job_id)) if a.job_id == job_id]


def find_stores(path: Path) -> list[StoreAddress]:
    """Stores under ``path``: a store root (job dirs) or one job dir (node dirs)."""
    path = Path(path)
    out: list[StoreAddress] = []
    if not path.is_dir():
        return out
    jobs = [path] if is_job_dir(path) else [j for j in sorted(path.iterdir()) if is_job_dir(j)]
    for job in jobs:
        for node_dir in job.iterdir():
            for rank_dir in node_dir.iterdir():
                m = re.fullmatch(r"rank(\d+)", rank_dir.name)
                if m and rank_dir.is_dir():
                    node = int(node_dir.name[4:])
                    out.append(StoreAddress(job.parent, job.name, node, int(m.group(1))))
    return sorted(out, key=lambda a: (a.job_id, a.rank))


def is_job_dir(path: Path) -> bool:
    children = [c for c in path.iterdir()] if path.is_dir() else []
    return bool(children) and all(c.is_dir() and re.fullmatch(r"node\d+", c.name) for c in children)
