"""Redundancy policies and coding groups: how snapshot shards are protected across
failure domains (nodes), before any byte is laid out.

:class:`Redundancy` is a policy (``none``, ``replicate:C``, ``xor:G``, ``rs:K+M``) in one
uniform shape, ``k`` data blocks and ``m`` redundant blocks per stripe;
:func:`coding_groups` places the ranks of a topology in groups of ``k + m`` members on
distinct nodes. What each member then stores and sends is :mod:`baft.store.coding`.

Pure: no numpy, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from baft.topology import Topology

KINDS = ("none", "replicate", "xor", "rs")
_FORMATS = "'none', 'replicate:C' (C>=1 copies), 'xor:G' (G>=2 members) or 'rs:K+M' (K,M>=1)"


@dataclass(frozen=True, slots=True)
class Redundancy:
    """How snapshot shards are protected across nodes.

    Uniform encoding: ``k`` data blocks and ``m`` redundant blocks per stripe, so
    ``group_size == k + m`` and ``tolerance == m`` for every kind. ``none`` is
    (k=1, m=0); ``replicate:C`` is (k=1, m=C); ``xor:G`` is (k=G-1, m=1); ``rs:K+M`` is
    (k=K, m=M).
    """

    kind: str
    """One of ``none``, ``replicate``, ``xor``, ``rs``."""
    k: int = 1
    """Data blocks per stripe (1 for none and replicate)."""
    m: int = 0
    """Redundant blocks per stripe = node losses tolerated per group."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"redundancy kind {self.kind!r} unknown; use {_FORMATS}")
        ok = {
            "none": self.k == 1 and self.m == 0,
            "replicate": self.k == 1 and self.m >= 1,
            "xor": self.k >= 1 and self.m == 1,
            "rs": self.k >= 1 and self.m >= 1 and self.k + self.m <= 256,
        }[self.kind]
        if not ok:
            raise ValueError(
                f"invalid {self.kind} redundancy k={self.k} m={self.m}; use {_FORMATS} "
                "(rs needs k+m <= 256)"
            )

    @classmethod
    def parse(cls, text: str) -> Redundancy:
        """Parse ``none`` | ``replicate:C`` | ``xor:G`` | ``rs:K+M``."""
        kind, _, arg = text.strip().partition(":")
        try:
            if kind == "none" and not arg:
                return cls(kind="none")
            if kind == "replicate":
                return cls(kind="replicate", k=1, m=int(arg))
            if kind == "xor":
                return cls(kind="xor", k=int(arg) - 1, m=1)
            if kind == "rs":
                k_text, plus, m_text = arg.partition("+")
                if plus:
                    return cls(kind="rs", k=int(k_text), m=int(m_text))
        except ValueError as err:
            raise ValueError(f"cannot parse redundancy {text!r}: {err}; use {_FORMATS}") from None
        raise ValueError(f"cannot parse redundancy {text!r}; use {_FORMATS}")

    @property
    def group_size(self) -> int:
        """Members per coding group (each on a distinct node)."""
        return self.k + self.m

    @property
    def tolerance(self) -> int:
        """Node losses tolerated per coding group."""
        return self.m

    def __str__(self) -> str:
        if self.kind == "none":
            return "none"
        if self.kind == "replicate":
            return f"replicate:{self.m}"
        if self.kind == "xor":
            return f"xor:{self.k + 1}"
        return f"rs:{self.k}+{self.m}"


def coding_groups(topology: Topology, red: Redundancy) -> tuple[tuple[int, ...], ...]:
    """Groups of ranks with the same local index on ``group_size`` consecutive nodes."""
    size = red.group_size
    if size > topology.num_nodes or topology.num_nodes % size:
        raise ValueError(
            f"redundancy {red} needs groups of {size} nodes but there are "
            f"{topology.num_nodes} nodes; pick a group size that divides {topology.num_nodes} "
            "(e.g. xor:G or rs:K+M with G or K+M a divisor) or change ranks_per_node"
        )
    groups = []
    for first in range(0, topology.num_nodes, size):
        nodes = range(first, first + size)
        for local in range(topology.ranks_per_node):
            groups.append(tuple(topology.ranks_on_node(n)[local] for n in nodes))
    return tuple(groups)


def group_of(topology: Topology, red: Redundancy, rank: int) -> tuple[int, ...]:
    """The coding group containing ``rank``."""
    for group in coding_groups(topology, red):
        if rank in group:
            return group
    raise ValueError(f"rank {rank} outside the topology {topology}")
