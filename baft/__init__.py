"""baft: bubble-aware fault tolerance for hybrid-parallel PyTorch training.

``baft.protect`` wraps your own pipeline schedule, stages and optimizer; ``baft`` on the
command line trains, demonstrates, plans, simulates, measures, inspects and traces.
"""

from __future__ import annotations

from typing import Any

from baft import config as _config  # no torch: records when this process imported baft

_CONFIGS = tuple(_config.__all__)
__all__ = [*_CONFIGS, "elastic_dp", "protect", "run"]


def __getattr__(name: str) -> Any:  # lazy: importing baft must not import torch.distributed
    if name == "protect":
        from baft.api import protect

        return protect
    if name == "elastic_dp":
        from baft.api import elastic_dp

        return elastic_dp
    if name == "run":
        from baft.inprocess.run import run

        return run
    if name in _CONFIGS:
        return getattr(_config, name)
    raise AttributeError(name)
