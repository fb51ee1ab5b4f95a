"""The version log of one rank's store: which version each slot holds, which one is
committed, and which one is being written right now.

:class:`VersionLog` owns the store's records: ``slot{s}.json`` (a slot's manifest:
``writing``, then ``complete`` with its checksums), ``commit.json`` (the newest globally
committed version) and the ``progress`` page (how many shard bytes of the version being
written are final, for same-host readers: :mod:`baft.store.progress`), whose file also
carries the store's liveness lock. Records are replaced atomically (write a temporary
file, rename), so a SIGKILL at any point leaves the last committed version intact:

``begin(v)`` picks a slot not holding the committed version and marks it ``writing``;
the engine fills it; ``complete(slot, manifest)`` records checksums; ``commit(v)`` moves
the commit record.
"""

from __future__ import annotations

import fcntl
import json
import logging
import mmap
import os
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from baft.store import progress
from baft.store.manifest import FORMAT, Manifest, dumps
from baft.store.paths import KINDS, PROGRESS_FILE
from baft.store.slots import PAGE, SlotFiles

log = logging.getLogger("baft")

T = TypeVar("T")
COMMIT_FILE = "commit.json"
"""The commit record: the newest globally committed version and its slot."""


def or_none(fn: Callable[..., T], *args: Any) -> T | None:
    """``fn(*args)``, or None where it raises ValueError (an unreadable record)."""
    try:
        return fn(*args)
    except ValueError:
        return None


def version_of(rec: dict[str, Any] | None) -> int:
    """The version a slot record names, -1 for none."""
    return int(rec["version"]) if rec and "version" in rec else -1


class VersionLog:
    """The records of the store whose slot files are ``files``."""

    def __init__(self, files: SlotFiles) -> None:
        self.files = files
        self.rank = files.rank
        self._progress: np.ndarray | None = None
        self._progress_map: mmap.mmap | None = None
        self._lock_fd = -1
        self._parsed = _Parsed()

    @property
    def _commit_file(self) -> Path:
        return self.files.path / COMMIT_FILE

    # ------------------------------------------------------------------ progress
    def open_progress(self) -> None:
        """Map the progress page (cleared: nothing being written) and take the lock."""
        fd = os.open(self.files.path / PROGRESS_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size != PAGE:
                os.ftruncate(fd, PAGE)
            progress_map = mmap.mmap(fd, PAGE)
            # A shared lock held while this process has the store allocated: the kernel
            # drops it when the process dies, so ``baft.store.reclaim`` can tell a live
            # job's store from an abandoned one without a registry.
            if _lock_shared(fd):
                self._lock_fd, fd = fd, -1
        finally:
            if fd >= 0:
                os.close(fd)
        self._progress_map = progress_map
        self._progress = progress.fields(progress_map)
        progress.clear(self._progress)

    def publish(self, version: int, slot: int, covered: int) -> None:
        """Tell same-host readers that the first ``covered`` shard bytes of ``version`` in
        ``slot`` are final (the page's layout and protocol: :mod:`baft.store.progress`)."""
        if self._progress is None:
            raise RuntimeError(f"rank {self.rank} store: call allocate() first")
        progress.publish(self._progress, version, slot, covered)

    def close_progress(self) -> None:
        """Release the liveness lock and unmap the progress page."""
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # releases the liveness lock
            self._lock_fd = -1
        self._progress = None
        if self._progress_map is not None:
            try:
                self._progress_map.close()
            except BufferError:
                pass
            self._progress_map = None

    # ------------------------------------------------------------------ versions
    def begin(self, version: int, keep: Collection[int] = ()) -> int:
        """Slot to write ``version`` into, marked ``writing``: never the committed one nor
        one holding a complete version in ``keep`` (a differential rotation's window; when
        not both can be kept, ``keep`` wins over a stale commit record); the oldest
        otherwise."""
        records = [or_none(self.record, s) for s in range(self.files.num_slots)]
        committed = or_none(self.committed_version)
        protected = {committed, *keep}
        candidates = [
            s
            for s, rec in enumerate(records)
            if not (rec and rec.get("state") == "complete" and rec.get("version") in protected)
        ]
        if not candidates and keep:  # the caller's window wins over a stale commit record
            candidates = [
                s
                for s, rec in enumerate(records)
                if not (rec and rec.get("state") == "complete" and rec.get("version") in keep)
            ]
        if not candidates:
            raise AssertionError(
                f"rank {self.rank}: every one of its {len(records)} slots holds a version "
                f"to keep ({[version_of(r) for r in records]}; keep {sorted(protected, key=str)})"
            )
        # an older copy of this very version (written before a restart) is the first to go
        slot = min(
            candidates,
            key=lambda s: (
                version_of(records[s]) != version,
                records[s] is not None,
                version_of(records[s]),
                s,
            ),
        )
        for other, rec in enumerate(records):  # never two copies of one version
            if other != slot and rec and rec.get("version") == version:
                self._forget(other)
        _write_json(
            self.files.file(slot, "json"),
            {"format": FORMAT, "state": "writing", "version": version, "rank": self.rank},
        )
        return slot

    def complete(self, slot: int, manifest: Manifest) -> None:
        """Record ``manifest`` (state complete) for the slot begun with its version."""
        manifest.check()
        rec = self.record(slot)
        if not rec or rec.get("state") != "writing" or rec.get("version") != manifest.version:
            raise ValueError(
                f"rank {self.rank} slot {slot} is not being written for v{manifest.version}; "
                "call begin(version) first and complete the slot it returned"
            )
        if manifest.rank != self.rank or manifest.state != "complete":
            raise ValueError(f"manifest is for rank {manifest.rank} state {manifest.state}")
        sizes = self.files.sizes
        if sizes and (manifest.data_nbytes > sizes[0] or manifest.red_nbytes > sizes[1]):
            raise ValueError(f"manifest sizes exceed the allocation {sizes}")
        _write_text(self.files.file(slot, "json"), dumps(manifest))

    def commit(self, version: int) -> None:
        """Record ``version`` as the newest globally committed version."""
        for slot in range(self.files.num_slots):
            rec = self.record(slot)
            if rec and rec.get("state") == "complete" and rec.get("version") == version:
                _write_json(self._commit_file, {"format": FORMAT, "version": version, "slot": slot})
                return
        raise ValueError(
            f"rank {self.rank}: no complete v{version} in the store; complete() it first"
        )

    def committed_version(self) -> int | None:
        """Version in the commit record, or None."""
        rec = self._parsed.load(self._commit_file)
        return rec.get("version") if rec else None

    def clear_versions(self, keep: int | None = None) -> None:
        """Forget every version and the commit record (after restoring from disk or fresh);
        ``keep``: except that version (and the commit record, if it names it)."""
        for slot in range(self.files.num_slots):
            if keep is None or version_of(or_none(self.record, slot)) != keep:
                self._forget(slot)
        if keep is None or or_none(self.committed_version) != keep:
            self._commit_file.unlink(missing_ok=True)

    def roll_back_to(self, version: int) -> bool:
        """If a slot holds a complete ``version``: forget every newer version and commit
        ``version`` (older ones stay: a differential rotation may need them to rebuild
        it); False (nothing changed) if none does."""
        keep = self.slot_of(version, self.files.num_slots)
        if keep is None:
            return False
        for slot in range(self.files.num_slots):
            rec = or_none(self.record, slot)
            if slot != keep and (rec is None or version_of(rec) > version):
                self._forget(slot)
        self.commit(version)
        return True

    def slot_of(self, version: int, num_slots: int) -> int | None:
        """The slot below ``num_slots`` whose complete manifest is ``version``, if its
        files are there."""
        for slot in range(min(num_slots, self.files.num_slots)):
            rec = or_none(self.record, slot)
            if (
                rec
                and rec.get("state") == "complete"
                and rec.get("version") == version
                and all(self.files.file(slot, kind).exists() for kind in KINDS)
            ):
                return slot
        return None

    def read_manifest(self, slot: int) -> Manifest | None:
        """The slot's complete manifest, or None (empty, writing or unreadable)."""
        rec = self.record(slot)
        if not rec or rec.get("state") != "complete":
            return None
        return Manifest.from_dict(rec)

    def record(self, slot: int) -> dict[str, Any] | None:
        """The slot's record as stored (None: none); ValueError if unreadable."""
        return self._parsed.load(self.files.file(slot, "json"))

    def _forget(self, slot: int) -> None:
        self.files.file(slot, "json").unlink(missing_ok=True)


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    _write_text(path, json.dumps(obj, separators=(",", ":")))


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _load_json(path: Path) -> dict[str, Any] | None:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise ValueError(f"{path}: not a baft record of format {FORMAT}")
    return obj


class _Parsed:
    """Records parsed before, by path, with the file's (inode, mtime ns, size) then.

    A version opens by reading every slot's record (K+1 manifests with their checksum
    lists) and commits by reading them again: read and parsed on the training thread at
    each version, ~0.8 ms per iteration (py-spy, K=8). Every write replaces the file (a
    new inode), so a stat tells a record unchanged. Callers get copies."""

    def __init__(self) -> None:
        self._seen: dict[str, tuple[tuple[int, int, int], dict[str, Any]]] = {}

    def load(self, path: Path) -> dict[str, Any] | None:
        key = str(path)
        try:
            st = os.stat(key)
        except FileNotFoundError:
            self._seen.pop(key, None)
            return None
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        hit = self._seen.get(key)
        if hit is not None and hit[0] == stamp:
            return dict(hit[1])
        obj = _load_json(path)
        if obj is None:
            return None
        self._seen[key] = (stamp, obj)  # keys: this store's K+1 slot records and its commit
        return dict(obj)


def _lock_shared(fd: int, attempts: int = 1000) -> bool:
    """Take the shared liveness lock, waiting out a liveness probe (``baft inspect``,
    ``reclaim``: they hold the exclusive lock for microseconds; giving up at once would
    leave a live store unlocked, so that a later ``--free`` could delete it). False only
    if the lock stays taken for about a second: someone is removing the store."""
    for _ in range(attempts):
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            time.sleep(0.001)
    log.warning("store lock %s stays taken: someone is removing this store", fd)
    return False
