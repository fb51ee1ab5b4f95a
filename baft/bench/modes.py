"""The modes ``baft bench overhead`` compares, by name."""

BASELINE_MODES = ("torch-save", "dcp-async", "checkfreq")
"""Modes implemented in :mod:`baft.bench.baselines`."""
ENGINE_MODES = ("naive-async", "baft")
"""Modes provided by ``baft.engine.engine.CheckpointEngine``."""
PEER_MODES = ("lm-resiliency", "dlrover-flash")
"""Modes backed by published libraries (:mod:`baft.bench.peers`, the ``peers`` extra)."""
ALL_MODES = ("none", *BASELINE_MODES, *ENGINE_MODES, *PEER_MODES)
"""Every mode ``baft bench overhead`` knows, in report order."""
