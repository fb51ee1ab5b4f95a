"""What ``baft bench overhead`` reports about each mode besides its timings (pure).

The worker records, per mode, the transport its redundancy used, the K (``full_every``)
an engine mode planned, a note where a mode does not run as it would on its GPU path,
its memory per rank (:mod:`baft_bench.memory`) and whether its newest checkpoint restored
bit for bit (:mod:`baft_bench.restorecheck`), under ``mode_facts`` of the raw results, and
the peer libraries' versions under ``peer_versions``;
:func:`baft_bench.aggregate.with_facts` moves them next to each mode's samples, so the
summary (the ``--json`` object and the page's input) carries them, merged over launches.
"""

from __future__ import annotations

from baft_bench.modes import ENGINE_MODES

MODE_FIELDS = ("transport", "k", "note", "memory", "restores", "restores_detail")
"""Per-mode facts the worker records (every one is in ``aggregate.EXTRA_MODE_KEYS``)."""


def mode_note(mode: str, compute: str) -> str | None:
    """Where ``mode`` as run here differs from its behaviour on its GPU path (None: not)."""
    emulated = compute == "emulated"
    if mode == "lm-resiliency":
        if emulated:
            return (
                "copy thread stands in for its CUDA copy stream (the library's CPU path "
                "is a synchronous copy_); the next optimizer step waits for it"
            )
        return "synchronous fallback, not its GPU behaviour (copy_ on the training thread)"
    if mode == "dcp-async":
        if emulated:
            return "async staging on DCP's staging thread (explicit StagingOptions)"
        return "synchronous fallback, not its GPU behaviour (staging on the training thread)"
    if mode == "dlrover-flash":
        return "no replica (replica_count is broken in 0.6.1): matched arm baft-noreplica"
    if mode == "bare":
        return "bare torch schedule (instrument=False) on a second Trainer"
    if mode in ENGINE_MODES and emulated:
        return "copy thread stands in for the DMA engine (snapshot_copy=thread)"
    return None
