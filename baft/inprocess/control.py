"""The supervisors' shared state: one c10d TCPStore hosted by the supervisor of rank 0.

Keys (under ``baft-inprocess/``):

- ``gen``: the job's current generation (``"0"`` at launch). A failure moves it on by
  one with ``compare_set`` from the generation the failed child ran in, so that several
  supervisors reporting the same failure start one recovery, not several.
- ``port/G``: the port of generation ``G``'s c10d store (the process groups' rendezvous),
  set by the supervisor of rank 0, which hosts it: a store per generation, so that no
  key of an aborted generation (gloo's peer addresses) is ever read again.
- ``cause/G``, ``at/G``: why generation ``G`` began and when (wall time), appended.
- ``kill/G``: ranks whose process must be replaced in generation ``G`` (frozen ranks a
  watchdog named), appended as ``"r,"``.
- ``beat/R``: supervisor ``R``'s heartbeat counter; ``done/R``: its child finished.
- ``host/R``: rank ``R``'s host (torchrun's ``GROUP_RANK``).
- ``world``: ``"G|r:h,..."``: from generation ``G`` on, the job runs on these launch ranks
  (and their hosts) alone: it shrank in-process after losing a host (elastic replicas).
- ``lease``: the port where rank 0's supervisor takes every peer supervisor's lease
  connection (:mod:`baft.inprocess.lease`: a peer's death is seen at once).
- ``ended``: some rank's training function returned after ``ft.close()`` agreed on
  every rank: the job ended, a failure after it is the rank's own (no recovery).
- ``giveup``: why in-process recovery gave up: every supervisor stops its child and
  exits non-zero, and torchrun restarts the group.
- ``refused``: why a training function refused (:class:`baft.errors.Refusal`): every
  attempt would refuse again, so every supervisor ends the job without a restart (a
  refusal sets ``giveup`` too: supervisors poll that one key).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

PREFIX = "baft-inprocess/"


class Control:
    """One supervisor's connection to the control store (rank 0's also hosts it)."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout_s: float) -> None:
        self.host = host
        self.rank = rank
        self.world_size = world_size
        store = dist.TCPStore(
            host, port, world_size, is_master=rank == 0,
            timeout=timedelta(seconds=timeout_s), wait_for_workers=False,
        )  # fmt: skip
        self.listen_port = store.port
        """Where the control store listens (``port``, or the one chosen for port 0)."""
        self.store: Any = dist.PrefixStore(PREFIX, store)  # stubs lack append()
        if rank == 0:
            for r in range(world_size):  # present from the start: one multi_get reads all
                self.store.compare_set(f"beat/{r}", "", "")
            self.store.set("gen", "0")
        self._gen_stores: dict[int, dist.TCPStore] = {}
        """Rank 0: the generation stores it hosts (the newest two are kept)."""
        self.hosted = -1
        """Rank 0: the newest generation whose store it opened (nobody entered a newer one)."""
        self.members: tuple[int, ...] = tuple(range(world_size))
        """The launch ranks in the job now (fewer after an in-process shrink)."""

    def generation(self) -> int:
        return int(self.store.get("gen"))

    def begin(self, after: int, cause: str, kill: Sequence[int] = ()) -> int:
        """Start generation ``after + 1`` unless one after ``after`` began already;
        returns the current generation."""
        g = after + 1
        for r in kill:
            self.store.append(f"kill/{g}", f"{r},")
        self.store.append(f"cause/{g}", cause + "; ")
        self.store.compare_set(f"at/{g}", "", f"{time.time():.6f}")
        return int(self.store.compare_set("gen", str(after), str(g)))

    def kill_list(self, g: int) -> set[int]:
        if not self.store.check([f"kill/{g}"]):
            return set()
        raw = self.store.get(f"kill/{g}").decode()
        return {int(r) for r in raw.split(",") if r}

    def describe(self, g: int) -> tuple[str, float]:
        """Why generation ``g`` began and when."""
        if g == 0 or not self.store.check([f"cause/{g}"]):
            return "", 0.0
        cause = self.store.get(f"cause/{g}").decode().rstrip("; ")
        at = float(self.store.get(f"at/{g}")) if self.store.check([f"at/{g}"]) else 0.0
        return cause, at

    def port(self, g: int) -> int | None:
        """Generation ``g``'s store port, once rank 0's supervisor published it."""
        key = f"port/{g}"
        return int(self.store.get(key)) if self.store.check([key]) else None

    def host_generation(self, g: int) -> int:
        """Rank 0: open generation ``g``'s store and publish its port."""
        if g not in self._gen_stores:
            store = dist.TCPStore(
                self.host, 0, self.world_size, is_master=True, wait_for_workers=False,
                timeout=timedelta(seconds=60),
            )  # fmt: skip
            self._gen_stores[g] = store
            self.hosted = max(self.hosted, g)
            for old in [k for k in self._gen_stores if k < g - 1]:
                del self._gen_stores[old]
            self.store.set(f"port/{g}", str(store.port))
        return self._gen_stores[g].port

    def publish_host(self, host: int) -> None:
        """This rank's host (torchrun's ``GROUP_RANK``): a shrink drops whole hosts."""
        self.store.set(f"host/{self.rank}", str(host))

    def hosts(self) -> dict[int, int] | None:
        """Every launch rank's host, as each supervisor published it (None until all did)."""
        keys = [f"host/{r}" for r in range(self.world_size)]
        if not self.store.check(keys):
            return None
        return {r: int(v) for r, v in enumerate(self.store.multi_get(keys))}

    def shrink(self, first: int, host_of: dict[int, int]) -> None:
        """Rank 0: from generation ``first`` on, the job runs on the ranks of ``host_of``
        (launch rank -> host) alone; set before ``first``'s store is opened, so that no
        supervisor enters it with the old world."""
        world = ",".join(f"{r}:{h}" for r, h in sorted(host_of.items()))
        self.store.set("world", f"{first}|{world}")

    def world(self, g: int) -> dict[int, int] | None:
        """The ranks (launch rank -> host) of generation ``g`` when the job shrank at or
        before it, else None (the launch's world)."""
        if not self.store.check(["world"]):
            return None
        first, _, world = self.store.get("world").decode().partition("|")
        if g < int(first):
            return None
        return {int(r): int(h) for r, h in (pair.split(":") for pair in world.split(","))}

    def publish_lease(self, port: int) -> None:
        """Rank 0: where its supervisor takes leases (:mod:`baft.inprocess.lease`)."""
        self.store.set("lease", str(port))

    def lease_port(self) -> int:
        """Where rank 0's supervisor takes leases (waits for it, up to the store timeout)."""
        return int(self.store.get("lease"))

    def beat(self, seq: int) -> None:
        self.store.set(f"beat/{self.rank}", str(seq))

    def beats(self) -> dict[int, bytes]:
        """Every started peer's heartbeat, or ``b"done"`` once it finished: one read of
        the store for all of them (the keys exist from the start, empty until a peer's
        first beat)."""
        peers = [r for r in self.members if r != self.rank]
        if not peers:
            return {}
        values = self.store.multi_get([f"beat/{r}" for r in peers])
        return {r: v for r, v in zip(peers, values, strict=True) if v}

    def finished(self) -> None:
        self.store.set(f"beat/{self.rank}", "done")

    def ended(self) -> None:
        """This rank's training function returned after the job's agreed end."""
        self.store.set("ended", str(self.rank))

    def job_ended(self) -> bool:
        """Whether some rank's training function returned after the job's agreed end
        (``ft.close()`` agreed on every rank): no failure is recovered any more."""
        return bool(self.store.check(["ended"]))

    def refuse(self, reason: str) -> None:
        """The job ends without a restart; ``giveup`` is set too, so that the one key a
        supervisor polls tells it to stop, and ``refused`` says how."""
        self.store.compare_set("refused", "", reason)
        self.store.compare_set("giveup", "", f"refused: {reason}")

    def refused(self) -> str | None:
        """Why the job ends without a restart, or None; read once ``given_up()`` is set."""
        return self.store.get("refused").decode() if self.store.check(["refused"]) else None

    def give_up(self, reason: str) -> None:
        self.store.compare_set("giveup", "", reason)

    def given_up(self) -> str | None:
        return self.store.get("giveup").decode() if self.store.check(["giveup"]) else None
