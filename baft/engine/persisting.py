"""What the engine hands the DCP persister: whole tensors of this rank's share.

- **Full snapshots** (``full_every=1``): typed views of the committed slot's bytes
  (:func:`slot_views`), no copy; the slot is not reused until the save is done.
- **Differential** (``full_every > 1``): a slot holds a payload, not the state, so every
  ``persist_every``-th version the live state is copied once more, in the background, to a
  host buffer (:class:`LiveCopy`) that the persister reads once that version commits.
- **SIGTERM flush**: the live tensors themselves (:func:`flush`), synchronously and
  bounded, because the process is about to exit.

DP replicas hold the same state: each persists its share of whole tensors
(:func:`replica_share`). Ranks along the shard axis (TP, FSDP2's ``dp_shard``) each write
their piece of every DTensor, but a plain tensor (FSDP2's optimizer ``step``) only from
shard rank 0, and that rank adds torch's flattened ``optimizer.param_groups.<fqn>.<k>``
entries decoded from the version's hyperparameter record (:func:`writes_of`): every key
is written by one rank. :class:`Persisting` owns the cadence (one rule for all three:
:meth:`Persisting.due`) and the save in flight.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch

from baft.engine.device import DeviceCopy
from baft.engine.flat import FlatState, typed_view
from baft.engine.priority import raised
from baft.liveness import generation
from baft.pipeline.state import decode_record
from baft.plan import names
from baft.store.disk import Persister, SaveHandle
from baft.store.disk_process import ProcessPersister
from baft.store.keys import KEYS_META, PersistKeys, persist_name
from baft.topology import Topology

log = logging.getLogger("baft")


def replica_share(
    named: list[tuple[str, torch.Tensor]], dp: int, num_dp: int
) -> list[tuple[str, torch.Tensor]]:
    """DP replica ``dp``'s share of whole tensors: every ``num_dp``-th from its index,
    and every persistent buffer from replica 0 alone. A version's buffers are captured at
    the end of ``optimizer.step()``, where replicas may still hold their own BatchNorm
    statistics: the loop syncs them afterwards from the first replica (as DDP does), so
    the first replica's are the ones every replica continues with (a buffer persisted
    from another replica made a SIGTERM flush's restart diverge)."""
    buffers = [(n, t) for n, t in named if n.startswith(names.BUFFER)]
    rest = [(n, t) for n, t in named if not n.startswith(names.BUFFER)]
    share = [(n, t) for i, (n, t) in enumerate(rest) if i % num_dp == dp]
    return share + buffers if dp == 0 else share


def writes_of(
    state: dict[str, Any],
    *,
    keys: PersistKeys,
    shard: int,
    sharded: Collection[str],
    meta_key: str | None,
    param_groups: Sequence[Sequence[str]],
) -> dict[str, Any]:
    """What one rank writes of ``state`` (DCP key -> tensor): on shard rank ``shard`` > 0
    only its DTensor pieces (``sharded`` keys) and its own records (``extra.*``), since
    its plain tensors are shard rank 0's too; on shard rank 0 also, when ``state`` holds
    the hyperparameter record (``meta_key``), torch's flattened param-group entries of
    its parameters (``param_groups``: FQNs per group)."""
    if shard:
        return {k: v for k, v in state.items() if k in sharded or k.startswith(names.EXTRA)}
    out = dict(state)
    if meta_key is not None and meta_key in state and keys.writes_param_groups:
        record = decode_record(state[meta_key])
        out.update(keys.param_groups(param_groups, record["hypers"]))
    return out


def slot_views(
    flat: FlatState,
    data: torch.Tensor,
    start: int,
    stop: int,
    key: Callable[[str], str] = persist_name,
) -> dict[str, torch.Tensor]:
    """Whole tensors of the flat range ``[start, stop)`` this rank owns, as typed views of
    a slot's bytes ``data`` (which begin at flat offset ``start``), by DCP ``key``."""
    out: dict[str, torch.Tensor] = {}
    for name, t, off in zip(flat.names, flat.tensors, flat.offsets, strict=True):
        n = t.numel() * t.element_size()
        if start <= off and off + n <= stop:
            out[key(name)] = typed_view(data[off - start : off - start + n], t.dtype, t.shape)
    return out


class LiveCopy:
    """A background copy of live tensors into one reused host buffer (pinned on CUDA)."""

    def __init__(
        self,
        device: torch.device,
        key: Callable[[str], str] = persist_name,
        alloc: Callable[[int], torch.Tensor] | None = None,
    ) -> None:
        self.device = device
        self.key = key
        """DCP key of a flat-state name."""
        self.alloc = alloc
        """Makes the buffer (bytes -> uint8 tensor): a shared file a writer process maps
        (:meth:`ProcessPersister.host_buffer`); None: torch's (pinned on CUDA)."""
        self._buf: torch.Tensor | None = None
        self.version: int | None = None
        self._layout: list[tuple[str, int, int, torch.dtype, torch.Size]] = []

    def reserve(self, nbytes: int) -> torch.Tensor:
        """The buffer for ``nbytes``, its pages touched: made when the plan is adopted, not
        at the first due version, whose copy would otherwise take every page fault of a
        fresh mapping inside the step's deadline (the first persisted iteration of a
        bench block took 0.9-2.1 s against 0.35 here)."""
        if self._buf is None or self._buf.numel() != nbytes:
            if self.alloc is not None:
                self._buf = self.alloc(nbytes)
            else:  # torch's own pinned allocator: freed (and unregistered) with the tensor
                self._buf = torch.empty(
                    nbytes, dtype=torch.uint8, pin_memory=self.device.type == "cuda"
                )
            self._buf.fill_(0)
        return self._buf

    def start(
        self, version: int, named: list[tuple[str, torch.Tensor]], copier: DeviceCopy
    ) -> None:
        """Start copying ``named`` (done by the copier's next ``synchronize``)."""
        flat = FlatState(named)
        buf = self.reserve(flat.nbytes)
        copier.start(flat.pairs(flat.pieces(0, flat.nbytes), buf))
        # typed only in take(): a misaligned tensor is read through a copy, which must
        # wait until the bytes have arrived
        self._layout = [
            (self.key(n), off, t.numel() * t.element_size(), t.dtype, t.shape)
            for n, t, off in zip(flat.names, flat.tensors, flat.offsets, strict=True)
        ]
        self.version = version

    def take(self, version: int) -> dict[str, torch.Tensor] | None:
        """The copied tensors if they are of ``version`` (then forgotten), else None."""
        if self.version != version:
            return None
        self.version = None
        assert self._buf is not None
        buf = self._buf
        return {
            key: typed_view(buf[off : off + n], dtype, shape)
            for key, off, n, dtype, shape in self._layout
        }


def flush(
    persister: Persister,
    version: int,
    state: dict[str, torch.Tensor],
    meta: dict[str, Any],
    timeout_s: float,
    where: str,
    at: str = "SIGTERM",
) -> None:
    """Persist ``state`` as ``version`` now, within ``timeout_s``; log the outcome (the
    caller goes on either way: what memory holds is still there for a restart). ``at``:
    "SIGTERM" (the process exits next) or "close" (the job's end)."""
    t0 = time.perf_counter()
    then = "; exiting" if at == "SIGTERM" else ""
    try:
        persister.save_async(version, state, meta).wait(timeout_s)
        log.log(
            logging.WARNING if then else logging.INFO, "%s: v%d flushed to %s in %.2f s%s",
            at, version, where, time.perf_counter() - t0, then,
        )  # fmt: skip
    except Exception as e:  # noqa: BLE001 - going on anyway; memory keeps the rest
        log.error("%s: flushing v%d failed (%s)%s", at, version, e, then)


class Persisting:
    """Every ``persist_every``-th checkpoint to DCP in the background, never blocking
    training, and the SIGTERM flush. Keeps the store from overwriting a slot the
    persister still reads (:meth:`reading_other_than`).

    A due version whose rank is still writing the previous save is not waited for: the
    rank says so in the version's commit vote (:meth:`ready`), no rank persists that
    version, and the next checkpoint is due instead (:attr:`owed`), until one is
    persisted. At a cadence the disk cannot sustain (``persist_every=1`` with a save
    slower than an iteration) the job persists as often as its disk allows and training
    never waits for it; :attr:`skipped` counts what it passed over."""

    def __init__(
        self,
        persister: Persister | None,
        *,
        every: int,
        interval: int,
        keys: PersistKeys,
        topology: Topology,
        rank: int,
        flat: FlatState,
        device: torch.device,
        layout_digests: dict[str, str],
        fire: Callable[[str, int], None] = lambda point, iteration: None,
        sharded: Collection[str] = (),
        param_groups: Sequence[Sequence[str]] = (),
    ) -> None:
        self.persister = persister
        self.every = every
        self.interval = max(1, interval)
        self.keys = keys
        self.topology = topology
        self.rank = rank
        self.flat = flat
        self.layout_digests = layout_digests
        self._fire = fire
        self._copy = LiveCopy(device, keys, getattr(persister, "host_buffer", None))
        self._inflight: tuple[int, SaveHandle, bool] | None = None
        """The save in flight: its version, its handle, and whether it reads the
        committed slot's mapping (full snapshots) rather than a live copy of its own."""
        self.owed = False
        """A due version was not persisted (a save was still writing on some rank): the
        next checkpoint is due, whatever the cadence. The same on every rank (it follows
        the commit votes)."""
        self.saved = 0
        """Saves started (not counting a SIGTERM flush)."""
        self.skipped = 0
        """Due versions not persisted because a rank's previous save was still writing."""
        self.sharded = frozenset(sharded)
        """DCP keys of DTensor pieces (every shard rank writes its own)."""
        self.param_groups = [list(g) for g in param_groups]
        """Parameter FQNs of every optimizer param group (torch's ``param_groups``)."""
        c = topology.coords(rank)
        self._shard = c.tp
        meta_of_rank = names.with_coords(names.EXTRA_META, names.extra_prefix(c.pp, c.tp))
        meta = [n for n in flat.names if n.startswith(meta_of_rank)]
        self._meta_key = keys(meta[0]) if meta else None

    def _writes(self, state: dict[str, Any]) -> dict[str, Any]:
        return writes_of(
            state, keys=self.keys, shard=self._shard, sharded=self.sharded,
            meta_key=self._meta_key, param_groups=self.param_groups,
        )  # fmt: skip

    def due(self, version: int) -> bool:
        """The cadence, one rule for slot views, the live copy and nothing else: the
        ``persist_every``-th checkpoint counted from version 0 (so a restarted job keeps
        the versions it persists)."""
        return (
            self.persister is not None
            and self.every > 0
            and version % self.interval == 0
            and (version // self.interval) % self.every == 0
        )

    def wanted(self, version: int) -> bool:
        """Due by the cadence, or owed since a due version was passed over."""
        return self.due(version) or (self.owed and self.persister is not None and self.every > 0)

    def busy(self) -> bool:
        """A save is still writing."""
        return self._inflight is not None and not self._inflight[1].done()

    def ready(self, version: int, *, differential: bool) -> bool:
        """This rank's commit vote on persisting ``version``: it is wanted and can start
        at the commit without waiting (differential: its live copy was taken; full
        snapshots: no save is still writing)."""
        if not self.wanted(version):
            return False
        return self._copy.version == version if differential else not self.busy()

    def _share(self) -> list[tuple[str, torch.Tensor]]:
        named = list(zip(self.flat.names, self.flat.tensors, strict=True))
        return replica_share(named, self.topology.coords(self.rank).dp, self.topology.num_dp)

    def adopted(self, *, differential: bool) -> None:
        """A plan was adopted: a differential job that persists gets its live copy's
        buffer now, outside any step (see :meth:`LiveCopy.reserve`)."""
        if differential and self.persister is not None and self.every > 0:
            self._copy.reserve(FlatState(self._share()).nbytes)

    def version_opened(self, version: int, *, differential: bool, copier: DeviceCopy) -> None:
        """Differential: a due version's live state (this DP replica's share) is copied
        in the background for the persister, read once that version commits."""
        if not differential or not self.wanted(version):
            return
        if self.busy():  # the buffer is still being written: not this version (see ready)
            return
        self.join()  # done: collect its outcome; the buffer is reused
        self._copy.start(version, self._share(), copier)

    def committed(
        self,
        version: int,
        *,
        differential: bool,
        slot_data: Callable[[], tuple[torch.Tensor, int, int]],
        agreed: bool = True,
    ) -> None:
        """``version`` committed: start its save if wanted and every rank was ready
        (``agreed``: the commit vote); otherwise the next checkpoint is owed. Full
        snapshots save typed views of the committed slot (``slot_data()``: its bytes and
        the owned flat range)."""
        copied = self._copy.take(version) if differential else None
        if not self.wanted(version):
            return
        if not agreed or (differential and copied is None):
            self.owed = True
            self.skipped += 1
            log.log(
                logging.INFO if self.skipped == 1 else logging.DEBUG,
                "v%d not persisted: a previous DCP save was still writing (%d passed over so "
                "far); the next checkpoint is persisted instead, training does not wait for "
                "the disk", version, self.skipped,
            )  # fmt: skip
            return
        if copied is not None:
            got = copied
            self._start(version, lambda: got, reads_store=False)
            return

        def views() -> dict[str, torch.Tensor]:
            data, start, stop = slot_data()
            return slot_views(self.flat, data, start, stop, self.keys)

        self._start(version, views, reads_store=True)

    def _start(
        self, version: int, state: Callable[[], dict[str, Any]], *, reads_store: bool
    ) -> None:
        assert self.persister is not None
        self._fire("persist", version)
        self.join()
        handle = self.persister.save_async(version, self._writes(state()), self.meta(version))
        self._inflight = (version, handle, reads_store)
        self.owed = False
        self.saved += 1

    def flush(self, version: int, timeout_s: float, where: str | None, at: str = "SIGTERM") -> None:
        """SIGTERM, or the job's end: persist the live state (version ``version``) now,
        within ``timeout_s``. Collective (the persister's group)."""
        if self.persister is None:
            return
        try:  # after the save in flight (a writer process's would race this one)
            self.join()
        except Exception as e:  # noqa: BLE001 - the flush is what matters now
            log.error("%s: the DCP save in flight failed (%s); flushing anyway", at, e)
            self._inflight = None
        state = self._writes({self.keys(n): t for n, t in self._share()})
        self.persister.background = False  # about to exit: nothing to yield the core to
        with self._boosted():
            flush(self.persister, version, state, self.meta(version), timeout_s, str(where), at)

    def meta(self, version: int) -> dict[str, Any]:
        """What a DCP checkpoint of ``version`` records in its ``baft_meta.json``."""
        return {
            "version": version,
            "rank_meta": {},
            "world_size": self.topology.world_size,
            KEYS_META: self.keys.scheme,
            "layouts": self.layout_digests,  # checked before a DCP restore writes a byte
        }

    def join(self) -> None:
        """Wait for the DCP save in flight, if any (its writer at normal priority
        meanwhile: waiting on an idle-priority thread is a priority inversion)."""
        if self._inflight is not None:
            with self._boosted():
                self._inflight[1].wait()
            self._inflight = None

    def _boosted(self) -> contextlib.AbstractContextManager[None]:
        p = self.persister
        if isinstance(p, ProcessPersister):
            return p.boosted()
        if p is None or p.native_id is None:
            return contextlib.nullcontext()
        return raised(p.native_id, p.lowered)

    def join_store_reads(self) -> None:
        """Before the store's mappings are replaced (a re-plan, a store lost): wait for
        the save in flight only if it reads them. A differential save reads its own live
        copy and goes on (waiting for it, the first one behind a writer process's start,
        stalled training for seconds)."""
        if self._inflight is not None and self._inflight[2]:
            self.join()

    def reading_other_than(self, committed: int | None) -> bool:
        """A save is still reading a slot that is not the committed one (the slot about
        to be overwritten)."""
        return self._inflight is not None and self._inflight[0] != committed

    def shutdown(self) -> None:
        """Finish the save in flight and stop the persister; while an in-process recovery
        abandons this generation, a writer process is killed instead (no collective, no
        wait: its peers' writers die with theirs or fail on their group)."""
        link = generation.current()
        if isinstance(self.persister, ProcessPersister) and link and link.pending():
            self._inflight = None
            self.persister.abort()
            return
        self.join()
        if self.persister is not None:
            self.persister.shutdown()
