"""What the checkpoint engine is built from: the state it snapshots and its collaborators.

The seam to the training state is :class:`baft.pipeline.live.LiveState`, the one Protocol
of the live state, which recovery uses too (``RunnerState`` implements it over the step
runner; tests use small fakes). :class:`EngineParts` are the collaborators that :func:`baft.engine.build.build_engine`
makes with I/O and hands in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from baft.engine.device import DeviceCopy
from baft.engine.scheduling import BubbleAware, Scheduling
from baft.engine.transport import Transport
from baft.engine.worker import ProtectWorker
from baft.liveness.termination import Termination
from baft.store.disk import Persister, PersistKeys
from baft.store.peer import PeerStore
from baft.store.shm import SnapshotStore


@dataclass
class EngineParts:
    """The engine's collaborators, made by :func:`baft.engine.build.build_engine`."""

    store: SnapshotStore
    transport: Transport
    copier: DeviceCopy
    """Copies live tensors at their slots (synchronous on CPU, asynchronous otherwise)."""
    spill_copier: DeviceCopy
    """Copies that fit no bubble, started at the iteration's start (always asynchronous)."""
    worker: ProtectWorker
    peers: dict[int, PeerStore]
    """Other ranks whose stores share this host's memory."""
    persister: Persister | None
    location: str | None = None
    """The memory holding this rank's store (:func:`baft.topology.memory_domains`): ranks
    with equal locations read each other's stores. None: the detected host id."""
    injector: Any = None
    """A :class:`baft.faults.injector.FaultInjector`, or None."""
    termination: Termination | None = None
    """SIGTERM flag: flush to DCP and exit at the next agreed commit (None: off)."""
    keys: PersistKeys = PersistKeys()
    """DCP keys of this rank's tensors (the job's scheme, agreed by every rank)."""
    scheduling: Scheduling = field(default_factory=BubbleAware)
    """When snapshot tasks start: at the plan's slots (default) or, for a baseline,
    all at the iteration's start (:class:`baft.engine.scheduling.AllAtStart`)."""
