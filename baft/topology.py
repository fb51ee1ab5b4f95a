"""Pure rank topology: rank <-> (pp, dp, tp) coordinates, simulated nodes, replica groups.

The DeviceMesh is laid out with axes ``("pp", "dp", "tp")`` in row-major order, so
``rank = (pp * num_dp + dp) * num_tp + tp``. A *node* is a failure domain: a block of
``ranks_per_node`` consecutive ranks that share host memory (one snapshot store) and
fail together. With the default layout TP peers share a node first, then DP replicas,
as on a real cluster where TP stays inside a server. :func:`memory_domains` says which
ranks' stores share memory (detected hosts and store roots); the declared nodes stay the
failure domains whatever it finds.

No processes, threads or I/O here: everything is a pure function of the sizes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Coords:
    """Coordinates of one rank on the (pp, dp, tp) mesh."""

    pp: int
    dp: int
    tp: int


@dataclass(frozen=True, slots=True)
class Topology:
    """Sizes of the mesh axes and of the simulated nodes.

    Raises ``ValueError`` with the fix when the sizes are not usable.
    """

    num_pp: int = 1
    """Pipeline-parallel degree (number of pipeline ranks)."""
    num_dp: int = 1
    """Data-parallel degree (number of replicas of each stage)."""
    num_tp: int = 1
    """Tensor-parallel degree."""
    ranks_per_node: int = 0
    """Ranks per failure domain; 0 means one node per rank pair (min(2, world))."""

    def __post_init__(self) -> None:
        for name in ("num_pp", "num_dp", "num_tp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.ranks_per_node == 0:
            object.__setattr__(self, "ranks_per_node", min(2, self.world_size))
        if self.ranks_per_node < 1 or self.world_size % self.ranks_per_node:
            raise ValueError(
                f"ranks_per_node={self.ranks_per_node} must divide the world size "
                f"{self.world_size} (= pp*dp*tp); pick a divisor of {self.world_size}"
            )

    @property
    def world_size(self) -> int:
        return self.num_pp * self.num_dp * self.num_tp

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    def coords(self, rank: int) -> Coords:
        self._check_rank(rank)
        tp = rank % self.num_tp
        dp = (rank // self.num_tp) % self.num_dp
        pp = rank // (self.num_tp * self.num_dp)
        return Coords(pp=pp, dp=dp, tp=tp)

    def rank_of(self, pp: int, dp: int, tp: int) -> int:
        if not (0 <= pp < self.num_pp and 0 <= dp < self.num_dp and 0 <= tp < self.num_tp):
            raise ValueError(f"coords (pp={pp}, dp={dp}, tp={tp}) outside mesh {self}")
        return (pp * self.num_dp + dp) * self.num_tp + tp

    def node_of(self, rank: int) -> int:
        self._check_rank(rank)
        return rank // self.ranks_per_node

    def local_index(self, rank: int) -> int:
        """Position of ``rank`` inside its node (0 .. ranks_per_node-1)."""
        self._check_rank(rank)
        return rank % self.ranks_per_node

    def ranks_on_node(self, node: int) -> tuple[int, ...]:
        if not 0 <= node < self.num_nodes:
            raise ValueError(f"node {node} outside 0..{self.num_nodes - 1}")
        first = node * self.ranks_per_node
        return tuple(range(first, first + self.ranks_per_node))

    def replicas(self, rank: int) -> tuple[int, ...]:
        """Ranks holding the same model state as ``rank`` (same pp and tp), ordered by dp."""
        c = self.coords(rank)
        return tuple(self.rank_of(c.pp, dp, c.tp) for dp in range(self.num_dp))

    def stage_ranks(self, pp: int) -> tuple[int, ...]:
        """All ranks of pipeline rank ``pp`` (every dp and tp)."""
        return tuple(
            self.rank_of(pp, dp, tp) for dp in range(self.num_dp) for tp in range(self.num_tp)
        )

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside 0..{self.world_size - 1}")


@dataclass(frozen=True, slots=True)
class MemoryDomains:
    """Which ranks' stores share memory, beside the declared failure domains."""

    locations: tuple[str, ...]
    """Per rank: the memory holding its store (a detected host, with the store root when
    that host's ranks use several). Ranks with equal locations read each other's stores
    in place (same-host exchange, recovery inventory); all other bytes use the network."""
    reason: str
    """What was detected and what is used (logged once at start)."""
    warning: str = ""
    """Set when a job on several hosts has a host holding ranks of several declared
    nodes: losing that host loses more than one failure domain."""


def memory_domains(topology: Topology, detected: Sequence[tuple[str, str]]) -> MemoryDomains:
    """Where the stores of ``topology``'s ranks live, from each rank's detected
    ``(host id, store root)``.

    The declared nodes (``ranks_per_node``) stay the failure domains that place the
    redundancy; detected shared memory is only an optimisation and never weakens them.
    Two ranks share a location only when they run on one detected host *and* keep their
    stores under one root: ranks of one host with different store roots (agents on one
    machine playing separate nodes) are separate memories, so wiping one root loses only
    the stores in it, and nobody reads another root's stores as if they were its own.
    """
    assert len(detected) == topology.world_size, (len(detected), topology.world_size)
    roots: dict[str, list[str]] = {}
    for host, root in detected:
        if root not in roots.setdefault(host, []):
            roots[host].append(root)
    locations = tuple(
        host if len(roots[host]) == 1 else f"{host}@{root}" for host, root in detected
    )
    ranks_at: dict[str, list[int]] = {}
    for r, loc in enumerate(locations):
        ranks_at.setdefault(loc, []).append(r)
    used = "; ".join(
        f"{loc}: ranks {_listed(rs)} ({_nodes(topology, rs)})" for loc, rs in ranks_at.items()
    )
    split = [h for h, rs in roots.items() if len(rs) > 1]
    reason = (
        f"failure domains: {topology.num_nodes} declared node(s) of {topology.ranks_per_node} "
        f"rank(s) (ranks_per_node) place the redundancy; detected {len(roots)} host(s)"
        + (f", {', '.join(split)} with several store roots, each its own memory" if split else "")
        + f"; stores shared in place within: {used}"
    )
    warning = ""
    if len(roots) > 1:
        for host in roots:
            rs = [r for r, (h, _) in enumerate(detected) if h == host]
            num_nodes = len({topology.node_of(r) for r in rs})
            if num_nodes > 1:
                warning = (
                    f"host {host} runs ranks {_listed(rs)} of declared {_nodes(topology, rs)}: "
                    f"losing that host loses {num_nodes} failure domains at once, more than "
                    "the redundancy may survive; set ranks_per_node to the number of ranks "
                    "per host (or a multiple of it)"
                )
                break
    return MemoryDomains(locations=locations, reason=reason, warning=warning)


def _nodes(topology: Topology, ranks: Sequence[int]) -> str:
    nodes = sorted({topology.node_of(r) for r in ranks})
    return f"node{'s' if len(nodes) > 1 else ''} {_listed(nodes)}"


def _listed(values: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    out: list[str] = []
    for v in values:
        if out and out[-1].split("-")[-1] == str(v - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{v}"
        else:
            out.append(str(v))
    return ",".join(out)
