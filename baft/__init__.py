"""baft: bubble-aware fault tolerance for hybrid-parallel PyTorch training.

``baft.protect`` wraps your own pipeline schedule, stages and optimizer; ``baft`` on the
command line trains, demonstrates, plans, simulates, benchmarks, inspects and traces.
"""

from __future__ import annotations

import time
from typing import Any

T_IMPORT = time.time()
"""When this process imported baft: about its start (recoveries time their restart to it)."""

__all__ = ["CheckpointConfig", "protect"]


def __getattr__(name: str) -> Any:  # lazy: importing baft must not import torch.distributed
    if name == "protect":
        from baft.api import protect

        return protect
    if name == "CheckpointConfig":
        from baft.config import CheckpointConfig

        return CheckpointConfig
    raise AttributeError(name)
