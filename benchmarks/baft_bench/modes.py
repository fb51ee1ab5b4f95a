"""The modes ``baft bench overhead`` compares, by name."""

BASELINE_MODES = ("torch-save", "dcp-async", "checkfreq")
"""Modes implemented in :mod:`baft_bench.baselines`."""
ENGINE_MODES = ("naive-async", "baft-full", "baft")
"""Modes provided by ``baft.engine.engine.CheckpointEngine``: ``baft`` is the default
engine (differential checkpoints, ``full_every`` as the policy says, ``auto`` unless set),
``baft-full`` the same engine with the whole state every version (``full_every=1``), and
``naive-async`` full snapshots all started at the iteration's start (:mod:`baft_bench.naive`)."""
PEER_MODES = ("lm-resiliency", "dlrover-flash")
"""Modes backed by published libraries (:mod:`baft_bench.peers`, the ``peers`` extra)."""
ALL_MODES = ("none", *BASELINE_MODES, *ENGINE_MODES, *PEER_MODES)
"""Every mode ``baft bench overhead`` knows, in report order."""
