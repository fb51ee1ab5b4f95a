"""Optional integrations of baft with training frameworks.

Each module here imports its framework lazily or not at all, so that ``import baft`` and
the modules themselves work without the framework installed:

* :mod:`baft.integrations.torchtitan`: ``BaftCheckpointManager``, baft as torchtitan's
  checkpoint manager (``checkpoint=BaftCheckpointManager.Config(...)``).
"""
