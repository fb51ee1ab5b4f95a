"""The directory layout of the disk tier and which of its versions are complete.

Under a checkpoint ``directory``::

    v00000012/            a DCP checkpoint (.metadata, __<rank>_0.distcp)
    v00000012/baft_meta.json   caller metadata, written by the coordinator
    v00000012/.complete   commit marker: every rank finished, metadata written
    latest                "12": the newest complete version (atomically replaced)

A version counts only once its ``.complete`` exists. This module names the files and
reads them; the writer that makes them is :class:`baft.store.disk.Persister`, loading a
version is :func:`baft.store.dcp_state.load_version`. Plain files: no torch.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

COMPLETE_MARKER = ".complete"
"""File inside a version directory that marks the checkpoint complete."""
LATEST_FILE = "latest"
"""File in the checkpoint root holding the newest complete version as decimal text."""
META_FILE = "baft_meta.json"
"""Caller metadata next to the DCP files, written by the coordinator."""
META_FORMAT = 1
"""Format number stored in ``baft_meta.json``."""

_VERSION_DIR = re.compile(r"^v(\d{8,})$")


def version_dir(directory: str | Path, version: int) -> Path:
    """Directory of ``version`` under ``directory`` (``v{version:08d}``)."""
    return Path(directory) / f"v{version:08d}"


def scan(directory: Path) -> tuple[list[int], list[int]]:
    """(complete, partial) versions found under ``directory``, each ascending."""
    complete: list[int] = []
    partial: list[int] = []
    if not directory.is_dir():
        return complete, partial
    for entry in directory.iterdir():
        match = _VERSION_DIR.match(entry.name)
        if match is None or not entry.is_dir():
            continue
        version = int(match.group(1))
        is_complete = (entry / COMPLETE_MARKER).is_file()
        (complete if is_complete else partial).append(version)
    return sorted(complete), sorted(partial)


def list_versions(directory: str | Path) -> list[int]:
    """Versions under ``directory`` that are complete checkpoints, ascending."""
    return scan(Path(directory))[0]


def latest_version(directory: str | Path) -> int | None:
    """The version named by the ``latest`` marker, or None when nothing is complete.

    The marker is trusted only when its version is complete; if it is missing, garbled
    or points at a deleted or partial directory, the newest complete version is
    returned instead.
    """
    root = Path(directory)
    try:
        marked: int | None = int((root / LATEST_FILE).read_text().strip())
    except (OSError, ValueError):
        marked = None
    if marked is not None and (version_dir(root, marked) / COMPLETE_MARKER).is_file():
        return marked
    complete = list_versions(root)
    return complete[-1] if complete else None


def select_prunable(complete: list[int], partial: list[int], keep_latest: int) -> list[int]:
    """Versions to delete: complete ones beyond the newest ``keep_latest``, and
    partial ones older than the newest complete (pure; inputs need not be sorted)."""
    if keep_latest < 1:
        raise ValueError(f"keep_latest must be >= 1, got {keep_latest}")
    ordered = sorted(complete)
    if not ordered:
        return []
    doomed = ordered[:-keep_latest]
    doomed += [v for v in partial if v < ordered[-1]]
    return sorted(doomed)


def read_metadata(directory: str | Path, version: int) -> dict[str, Any]:
    """Caller metadata stored with ``version`` ({} when the file is absent)."""
    path = version_dir(directory, version) / META_FILE
    if not path.is_file():
        return {}
    record = json.loads(path.read_text())
    meta = record.get("metadata", {})
    assert isinstance(meta, dict), f"corrupt {path}"
    return meta
