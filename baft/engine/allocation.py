"""The store's slots, (re)allocated for a plan on every rank at once.

A collective allocation, so that a rank over its memory budget (or a full tmpfs) fails
every rank with the same error instead of leaving its peers blocked in the next
collective until they time out. On CUDA the slots are page-locked so that device copies
are DMA, and unregistered before they go.
"""

from __future__ import annotations

import logging

import torch

from baft.engine.device import DeviceCopy, HostPins
from baft.engine.transport import Transport
from baft.store.shm import MemoryBudgetError, SnapshotStore

log = logging.getLogger("baft")


class StoreSlots:
    """Allocates ``store``'s slots; nothing may copy into a slot while it is replaced."""

    def __init__(
        self,
        store: SnapshotStore,
        transport: Transport,
        device: torch.device,
        copiers: tuple[DeviceCopy, ...],
    ) -> None:
        self.store = store
        self.transport = transport
        self.device = device
        self.copiers = copiers
        self._pins = HostPins()
        self.sizes: tuple[int, int, int] = (0, 0, 2)
        """The last allocation: shard bytes, redundancy bytes, slots."""

    def allocate_everywhere(self, sizes: tuple[int, int, int], keep: int | None) -> int | None:
        """Allocate on every rank (collective). ``keep``: the committed version stays
        restorable across a new plan's layout (its slot keeps its bytes, see
        :meth:`SnapshotStore.allocate`), so a crash before the new plan's first commit
        still loses one iteration. Returns it if every rank kept it (when the larger
        slots do not fit the budget, none does: the old behaviour)."""
        error: str | None = None
        kept: int | None = None
        try:
            kept = self.allocate(sizes, keep)
        except MemoryBudgetError as e:
            error = str(e)
        gathered = self.transport.all_gather_object((error, kept))
        errors = [e for e, _ in gathered if e]
        if errors and keep is not None:
            log.warning("the committed v%d cannot be kept across the new plan: %s", keep, errors[0])
            return self.allocate_everywhere(sizes, None)
        if errors:
            raise MemoryBudgetError(errors[0])
        return keep if keep is not None and all(k == keep for _, k in gathered) else None

    def allocate(self, sizes: tuple[int, int, int], keep: int | None = None) -> int | None:
        """(Re)create this rank's slots; on CUDA pin them so device copies are DMA."""
        for copier in self.copiers:  # no copy may still land in a slot that goes away
            copier.synchronize()
        self._pins.release()
        data_nbytes, red_nbytes, num_slots = sizes
        kept = self.store.allocate(data_nbytes, red_nbytes, num_slots, keep_version=keep)
        self.sizes = sizes
        if self.device.type == "cuda":
            for slot in range(num_slots):
                self._pins.pin(torch.from_numpy(self.store.data_view(slot)))
        return kept

    def release(self) -> None:
        self._pins.release()
