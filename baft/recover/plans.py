"""What recovery decides, and the stores it decides from: plain frozen records.

:class:`StoreRef` and :class:`LocatedInventory` say where a store is and what it holds;
:class:`Located` is what the agreement saw on every host. :class:`RecoveryPlan` is the
decision every rank reaches alike: the version, per rank where its shard comes from
(:class:`ShardSource`), and the sends (:class:`PieceTransfer`) and parity rebuilds
(:class:`Decode`) that obtain it; :class:`VersionAssessment` is one version's verdict on
the way there. :class:`TopologyMismatchError` refuses stores written under other sizes.

No processes, threads or I/O here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from baft.errors import Refusal
from baft.store.coding import GroupLayout, Recipe
from baft.store.manifest import RankInventory

SOURCES = ("memory", "disk", "fresh")
SHARD_KINDS = ("local", "remote", "replica", "parity")


class TopologyMismatchError(ValueError, Refusal):
    """Stores hold snapshots written under other pp/dp/tp sizes than the job's now."""

    def __init__(self, message: str, detail: str = "") -> None:
        super().__init__(message)
        self.detail = detail or message
        """What differs, without the advice."""


@dataclass(frozen=True, slots=True, order=True)
class StoreRef:
    """One store directory and the host whose memory holds it."""

    host: str
    """Host id (same machine, same boot; ``BAFT_HOST_ID`` in tests)."""
    node: int
    """Node number in the directory name."""
    rank: int
    """Rank number in the directory name: the logical shard it holds."""

    def __str__(self) -> str:
        return f"{self.host}:node{self.node}/rank{self.rank}"


@dataclass(frozen=True, slots=True)
class LocatedInventory:
    """A store's inventory and where the store is."""

    store: StoreRef
    """The directory and its host."""
    inventory: RankInventory
    """What it holds."""


@dataclass(frozen=True)
class Located:
    """What the agreement saw: every rank's host and every store on any host."""

    hosts: dict[int, str]
    stores: list[LocatedInventory]
    resize: Any = None
    """A restore into another DP degree (:class:`baft.recover.resize.Resize`): then
    ``hosts`` are the logical (old) ranks' and the plans name logical ranks."""

    def holds_shards(self) -> bool:
        """Whether any store holds any version of the job (complete or not)."""
        return any(loc.inventory.versions for loc in self.stores)


@dataclass(frozen=True, slots=True)
class ShardSource:
    """Where one rank's shard of the chosen version comes from."""

    kind: str
    """``local`` (a store on the rank's own host), ``remote`` (the whole shard moved from
    another host's memory), ``replica`` (a peer's replica region) or ``parity``."""
    holders: tuple[int, ...]
    """Ranks providing bytes: the rank itself, the sender, the replica holder, or the
    decode inputs."""
    region_ids: tuple[int, ...] = ()
    """Redundancy regions used (ids in the group's ``GroupLayout``)."""
    slot: int | None = None
    """For ``local`` and ``remote``: the slot of ``store`` holding the version."""
    store: StoreRef | None = None
    """For ``local`` and ``remote``: the store directory holding the shard."""


@dataclass(frozen=True, slots=True)
class PieceTransfer:
    """Bytes one rank sends to another during recovery."""

    src_rank: int
    """Sender."""
    dst_rank: int
    """Receiver (the rank whose shard is being rebuilt)."""
    kind: str
    """``shard`` (a range of the sender's data file) or ``region`` (of its redundancy file)."""
    src_slot: int
    """Slot of the sender's store holding the version."""
    offset: int
    """Start inside the sender's data or redundancy file."""
    nbytes: int
    """Length (never 0)."""
    region_id: int = -1
    """Region id for ``region`` transfers, -1 for ``shard``."""
    src_store: StoreRef | None = None
    """Store directory the sender reads (None: the sender's own)."""


@dataclass(frozen=True, slots=True)
class Decode:
    """A rank rebuilds its shard from received pieces with ``layout.rebuild``."""

    rank: int
    """Rank whose shard is rebuilt (it does the decoding)."""
    layout: GroupLayout
    """Its coding group's layout."""
    recipe: Recipe
    """Which shard ranges and regions the decode reads."""


@dataclass(frozen=True, slots=True)
class RecoveryPlan:
    """What every rank does to resume; ``version`` is the state to load."""

    version: int | None
    """Version to restore (None for a fresh start)."""
    source: str
    """``memory``, ``disk`` or ``fresh``."""
    shards: Mapping[int, ShardSource] = field(default_factory=dict)
    """Per rank, where its shard comes from (memory only)."""
    transfers: tuple[PieceTransfer, ...] = ()
    """Peer-to-peer sends needed before decoding / copying replicas."""
    decodes: tuple[Decode, ...] = ()
    """Parity rebuilds, one per rank that decodes."""
    shard_nbytes: Mapping[int, int] = field(default_factory=dict)
    """Shard size of every rank at ``version`` (memory only)."""

    def origins(self) -> dict[int, dict[str, object]]:
        """Per rank, how its shard was obtained and from which stores (host:directory)
        read by which ranks: what ``recoveries.jsonl`` records."""
        out: dict[int, dict[str, object]] = {}
        for rank, src in self.shards.items():
            if src.store is not None:
                stores = [str(src.store)]
            else:
                stores = sorted(
                    {str(t.src_store) for t in self.transfers if t.dst_rank == rank and t.src_store}
                )
            out[rank] = {"kind": src.kind, "ranks": list(src.holders), "stores": stores}
        return out


@dataclass(slots=True)
class VersionAssessment:
    """Whether one version is recoverable from memory, and how (from ``assess_version``)."""

    ok: bool
    why_not: str = ""
    shards: dict[int, ShardSource] = field(default_factory=dict)
    transfers: list[PieceTransfer] = field(default_factory=list)
    decodes: list[Decode] = field(default_factory=list)
    shard_nbytes: dict[int, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
