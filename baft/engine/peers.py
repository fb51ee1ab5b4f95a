"""Which ranks share this host's memory: their stores are read directly, not over the network.

Ranks with equal :func:`~baft.store.paths.host_id` (same machine, same boot) that keep their stores under
one store root share a location (:func:`baft.topology.memory_domains`): they exchange
redundancy through the store (``exchange=auto``) and inventory each other's stores at
recovery; all other traffic uses the transport (see :mod:`baft.engine.redundancy`). Agents
on one machine with a store root each are separate memories, as the declared nodes say.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from baft.engine.transport import Transport
from baft.store.paths import host_id
from baft.store.peer import PeerStore
from baft.topology import Topology, memory_domains

log = logging.getLogger("baft")


def find_same_host_peers(
    transport: Transport,
    store_path: Path,
    root: Path,
    topology: Topology,
    *,
    enabled: bool = True,
    host: str | None = None,
) -> tuple[str, dict[int, PeerStore]]:
    """This rank's location and the other ranks sharing it -> read-only views of their
    stores (none with ``enabled=False``). ``root``: this rank's store root; ``host``: the
    detected host (default :func:`host_id`). Rank 0 logs what was detected and what is
    used. Collective (every rank calls it, also with ``enabled=False``)."""
    me = {"host": host or host_id(), "root": os.path.realpath(root), "store": str(store_path)}
    everyone = transport.all_gather_object(me)
    domains = memory_domains(topology, [(info["host"], info["root"]) for info in everyone])
    if transport.rank == 0:
        log.info("%s", domains.reason)
        if domains.warning:
            log.warning("%s", domains.warning)
    here = domains.locations[transport.rank]
    if not enabled:
        return here, {}
    return here, {
        r: PeerStore(info["store"], r)
        for r, info in enumerate(everyone)
        if r != transport.rank and domains.locations[r] == here
    }
