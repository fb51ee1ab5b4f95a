"""Pure fault specifications: parse ``KIND[:ARGS]`` text, say whom, where and when a fault hits.

One grammar serves tests, the demo, the measurement harness and ``baft train --inject SPEC``. A
:class:`FaultSpec` is plain data; :meth:`FaultSpec.targets` and :meth:`FaultSpec.matches`
decide, as pure functions of a rank, the topology, a point and an iteration, whether the
fault fires there. :class:`FaultRecord` is one line of ``faults.jsonl`` (a fault that fired).

No I/O, processes or signals here: :mod:`baft.faults.injector` acts on these decisions.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from baft.topology import Topology

KINDS = ("kill", "node", "corrupt", "delete", "power", "hang", "freeze", "slow")
"""Fault kinds, in the order the grammar lists them."""
POINTS = ("iteration", "snapshot", "transfer", "persist", "step", "recovery", "close")
"""Places in a rank's iteration where ``FaultInjector.fire`` is called."""
TARGETS = ("data", "redundancy")
"""Which file of a committed slot ``corrupt`` damages."""
DEFAULT_POINT = "step"
SLOT_POINT = "slot"
"""Point recorded for ``slow`` faults (they act at every pipeline slot)."""

GRAMMAR = """\
fault spec grammar: KIND[:ARGS], ARGS comma-separated key=value (a bare first value is
the main target: rank, or node for `node`); POINT is one of
iteration|snapshot|transfer|persist|step|recovery|close (default step):
  kill:rank=R,iter=I[,at=POINT]          SIGKILL rank R
  node:N,iter=I[,at=POINT]               lose simulated node N (its stores) and SIGKILL its ranks
  corrupt:rank=R,iter=I[,target=data|redundancy][,at=POINT]
                                         flip one byte of R's newest committed slot
  delete:rank=R,iter=I[,at=POINT]        delete rank R's store directory, keep training
  power:iter=I[,at=POINT]                delete every store of the job and SIGKILL every rank
  hang:rank=R,iter=I[,at=POINT]          rank R sleeps forever
  freeze:rank=R,iter=I[,at=POINT]        rank R stops itself with SIGSTOP (all its threads)
  slow:rank=R,iter=I,s=SECONDS[,iters=K] rank R sleeps SECONDS at each slot for K iterations
a fault fires once per job, the first time its rank reaches POINT in an iteration >= I
(for at=recovery: the first restore that resumes at iteration I or later; for at=close:
ft.close() at the job's end, its newest committed version >= I, before the ranks agree
that the job ended)"""

_KEYS: dict[str, tuple[str, ...]] = {
    "kill": ("rank", "iter", "at"),
    "node": ("node", "iter", "at"),
    "corrupt": ("rank", "iter", "target", "at"),
    "delete": ("rank", "iter", "at"),
    "power": ("iter", "at"),
    "hang": ("rank", "iter", "at"),
    "freeze": ("rank", "iter", "at"),
    "slow": ("rank", "iter", "s", "iters"),
}
_REQUIRED: dict[str, tuple[str, ...]] = {
    "kill": ("rank", "iter"),
    "node": ("node", "iter"),
    "corrupt": ("rank", "iter"),
    "delete": ("rank", "iter"),
    "power": ("iter",),
    "hang": ("rank", "iter"),
    "freeze": ("rank", "iter"),
    "slow": ("rank", "iter", "s"),
}
_MAIN = {"node": "node", "power": None}
_TERMINAL = ("hang", "freeze", "kill", "node", "power")
_TARGET_ALIASES = {"data": "data", "redundancy": "redundancy", "red": "redundancy"}


def _bad(text: str, problem: str) -> ValueError:
    return ValueError(f"bad fault spec {text!r}: {problem}\n{GRAMMAR}")


def _int(text: str, key: str, value: str, minimum: int = 0) -> int:
    try:
        n = int(value)
    except ValueError:
        raise _bad(text, f"{key}={value!r} is not an integer") from None
    if n < minimum:
        raise _bad(text, f"{key}={n} must be >= {minimum}")
    return n


def _seconds(text: str, value: str) -> float:
    try:
        s = float(value)
    except ValueError:
        raise _bad(text, f"s={value!r} is not a number of seconds") from None
    if not math.isfinite(s) or s < 0:
        raise _bad(text, f"s={value} must be a finite number >= 0")
    return s


def _format_seconds(s: float) -> str:
    return str(int(s)) if s.is_integer() else repr(s)


def _split(text: str) -> tuple[str, dict[str, str]]:
    """``KIND`` and its ``key -> value`` arguments (bare first value under the main key)."""
    kind, _, rest = text.strip().partition(":")
    kind = kind.strip()
    if kind not in KINDS:
        raise _bad(text, f"unknown kind {kind!r}; kinds are {', '.join(KINDS)}")
    args: dict[str, str] = {}
    parts = [p.strip() for p in rest.split(",")] if rest.strip() else []
    for i, part in enumerate(parts):
        key, eq, value = part.partition("=")
        if not eq:
            main = _MAIN.get(kind, "rank")
            if i or main is None:
                raise _bad(text, f"{part!r} needs the form key=value")
            key, value = main, part
        key, value = key.strip(), value.strip()
        if key not in _KEYS[kind]:
            raise _bad(text, f"{kind} takes keys {', '.join(_KEYS[kind])}, not {key!r}")
        if key in args:
            raise _bad(text, f"{key} given twice")
        if not value:
            raise _bad(text, f"{key} has no value")
        args[key] = value
    missing = [k for k in _REQUIRED[kind] if k not in args]
    if missing:
        raise _bad(text, f"{kind} needs {', '.join(missing)}")
    return kind, args


@dataclass(frozen=True, kw_only=True, slots=True)
class FaultSpec:
    """One fault to inject: what happens, to whom, where in the iteration, and when."""

    kind: str
    """One of ``KINDS``."""
    rank: int | None = None
    """Target rank (kill, corrupt, delete, hang, slow); None for node and power."""
    node: int | None = None
    """Target simulated node (``node`` kind only)."""
    iteration: int
    """First iteration in which the fault may fire (for ``recovery``: the resume iteration)."""
    point: str = DEFAULT_POINT
    """Where in the iteration it fires, one of ``POINTS`` (``slow`` acts at every slot)."""
    seconds: float = 0.0
    """Delay per slot (``slow`` only)."""
    num_iters: int = 1
    """Number of iterations a ``slow`` fault lasts."""
    target: str = "data"
    """File of the committed slot that ``corrupt`` damages: ``data`` or ``redundancy``."""
    text: str = field(default="", compare=False)
    """The text it was parsed from (informational; ``str()`` gives the normalised form)."""

    @classmethod
    def parse(cls, text: str) -> FaultSpec:
        """Parse ``KIND[:ARGS]``; ``ValueError`` with the grammar on any mistake."""
        if not isinstance(text, str):
            raise _bad(str(text), "a fault spec is a string")
        kind, args = _split(text)
        point = args.get("at", DEFAULT_POINT)
        if point not in POINTS:
            raise _bad(text, f"at={point!r} is not one of {', '.join(POINTS)}")
        target = args.get("target", "data")
        if target not in _TARGET_ALIASES:
            raise _bad(text, f"target={target!r} is not one of {', '.join(TARGETS)}")
        return cls(
            kind=kind,
            rank=_int(text, "rank", args["rank"]) if "rank" in args else None,
            node=_int(text, "node", args["node"]) if "node" in args else None,
            iteration=_int(text, "iter", args["iter"]),
            point=point,
            seconds=_seconds(text, args["s"]) if "s" in args else 0.0,
            num_iters=_int(text, "iters", args["iters"], minimum=1) if "iters" in args else 1,
            target=_TARGET_ALIASES[target],
            text=text.strip(),
        )

    def __str__(self) -> str:
        parts: list[str] = []
        if self.kind == "node":
            parts.append(str(self.node))
        elif self.rank is not None:
            parts.append(f"rank={self.rank}")
        parts.append(f"iter={self.iteration}")
        if self.kind == "slow":
            parts.append(f"s={_format_seconds(self.seconds)}")
            if self.num_iters != 1:
                parts.append(f"iters={self.num_iters}")
        if self.kind == "corrupt" and self.target != "data":
            parts.append(f"target={self.target}")
        if self.kind != "slow" and self.point != DEFAULT_POINT:
            parts.append(f"at={self.point}")
        return f"{self.kind}:{','.join(parts)}"

    @property
    def spec_id(self) -> str:
        """Stable identity of the fault (the normalised text), used in ``faults.jsonl``."""
        return str(self)

    @property
    def terminal(self) -> bool:
        """The fault stops the process (kill, node, power) or blocks it forever (hang)."""
        return self.kind in _TERMINAL

    def check(self, topology: Topology) -> None:
        """``ValueError`` if the target rank or node does not exist in ``topology``."""
        if self.rank is not None and self.rank >= topology.world_size:
            raise ValueError(
                f"fault {self}: rank {self.rank} does not exist; ranks are "
                f"0..{topology.world_size - 1}"
            )
        if self.node is not None and self.node >= topology.num_nodes:
            raise ValueError(
                f"fault {self}: node {self.node} does not exist; nodes are "
                f"0..{topology.num_nodes - 1} ({topology.ranks_per_node} ranks per node)"
            )

    def targets(self, rank: int, topology: Topology) -> bool:
        """The fault acts on ``rank``: its own rank, every rank of its node, or all (power)."""
        if self.kind == "power":
            return True
        if self.kind == "node":
            return topology.node_of(rank) == self.node
        return self.rank == rank

    def matches(self, point: str, iteration: int) -> bool:
        """The fault is due at ``point`` of ``iteration`` (if it has not fired yet)."""
        return self.kind != "slow" and point == self.point and iteration >= self.iteration

    def slows(self, iteration: int) -> bool:
        """A ``slow`` fault covers ``iteration``."""
        return self.kind == "slow" and self.iteration <= iteration < self.iteration + self.num_iters


def parse_specs(texts: Iterable[str], topology: Topology | None = None) -> tuple[FaultSpec, ...]:
    """Parse several specs (``--inject`` repeated); duplicates and, given a topology,
    targets outside it raise ``ValueError``."""
    specs: list[FaultSpec] = []
    seen: dict[str, str] = {}
    for text in texts:
        spec = FaultSpec.parse(text)
        if spec.spec_id in seen:
            raise ValueError(
                f"fault {text!r} repeats {seen[spec.spec_id]!r}; each fault fires once, "
                "give it once (or change iter to inject it again later)"
            )
        seen[spec.spec_id] = text
        if topology is not None:
            spec.check(topology)
        specs.append(spec)
    return tuple(specs)


@dataclass(frozen=True, kw_only=True, slots=True)
class FaultRecord:
    """One fault that fired: a line of ``{run_dir}/faults.jsonl``."""

    spec: str
    """``FaultSpec.spec_id`` of the fault."""
    rank: int
    """Rank that fired it (node and power faults fire on several ranks)."""
    time: float
    """Epoch seconds just before the fault acted."""
    iteration: int
    """Iteration in which it fired (for ``recovery``: the resume iteration)."""
    point: str
    """Point at which it fired (``POINTS``, or ``slot`` for slow)."""

    def to_json(self) -> str:
        """One JSON line (with the trailing newline)."""
        obj = {
            "spec": self.spec,
            "rank": self.rank,
            "time": self.time,
            "iteration": self.iteration,
            "point": self.point,
        }
        return json.dumps(obj, separators=(",", ":")) + "\n"

    @classmethod
    def from_json(cls, line: str) -> FaultRecord:
        """Parse one line; ``ValueError`` if it is not a fault record."""
        try:
            obj: Any = json.loads(line)
            return cls(
                spec=str(obj["spec"]),
                rank=int(obj["rank"]),
                time=float(obj["time"]),
                iteration=int(obj["iteration"]),
                point=str(obj["point"]),
            )
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
            raise ValueError(f"not a fault record: {line!r} ({err})") from None


def parse_records(text: str) -> tuple[FaultRecord, ...]:
    """Records of a ``faults.jsonl`` text; blank and torn lines are skipped."""
    out = []
    for line in text.splitlines():
        if line.strip():
            try:
                out.append(FaultRecord.from_json(line))
            except ValueError:
                continue
    return tuple(out)
