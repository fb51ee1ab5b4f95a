"""Which ranks share this host's memory: their stores are read directly, not over the network.

Ranks with equal :func:`host_id` (same machine, same boot) whose store directory is
visible here exchange redundancy through the store (``exchange=auto``); only traffic
between hosts uses the transport (see :mod:`baft.engine.redundancy`).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from baft.engine.transport import Transport
from baft.store.peer import PeerStore


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


def find_same_host_peers(
    transport: Transport, store_path: Path, *, enabled: bool = True
) -> dict[int, PeerStore]:
    """Other ranks on this host -> read-only views of their stores. Collective (every rank
    calls it, also with ``enabled=False``, which finds none)."""
    me = {"host": host_id(), "store": str(store_path)}
    everyone = transport.all_gather_object(me)
    if not enabled:
        return {}
    return {
        r: PeerStore(info["store"], r)
        for r, info in enumerate(everyone)
        if r != transport.rank and info["host"] == me["host"]
    }
