"""The live training state as the checkpoint engine and recovery see it: :class:`LiveState`.

One Protocol for both sides of a checkpoint: the engine (:mod:`baft.engine`) snapshots
its tensors and captures its small state at each version's start; recovery
(:mod:`baft.recover`) checks a saved layout against it, writes restored bytes into its
tensors, applies the small state and replays optimizer steps with its optimizer. It sits
in ``pipeline``, below both, so that neither imports the other for it.
``baft.engine.build.RunnerState`` implements it over a step runner's
:class:`~baft.pipeline.state.TrainingState`; tests use small fakes.
"""

from __future__ import annotations

from typing import Protocol

import torch

__all__ = ["LiveState"]


class LiveState(Protocol):
    """A fixed list of named tensors, plus small state (RNG, hyperparameters, ``state=``
    objects) that lives in some of those tensors, and the live objects behind them.

    Implementations may also offer ``layout_digests``, ``global_layouts()`` and the
    deferred-state methods of :class:`baft.recover.differential.DeferredState`; their
    users look them up and do without."""

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The live optimizer (a differential restore replays steps with it)."""
        ...

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Every checkpointed tensor by flat-state name, canonical order; the list never
        changes."""
        ...

    def named_params(self) -> dict[str, torch.Tensor]:
        """Parameter FQN -> parameter (the ``model.<fqn>`` tensors' owners; a replay's
        groups)."""
        ...

    def capture(self) -> None:
        """Refresh the small-state tensors from the live objects (a version's start);
        with DP replicas, also the copies of the other replicas' own records
        (:mod:`baft.pipeline.replicas`). Collective over a stage's replicas."""
        ...

    def apply(self) -> None:
        """Load the small state from its tensors into the live objects (after a restore)."""
        ...

    def check_layout(self, saved: list[tuple[str, int]]) -> None:
        """Raise ValueError naming the differences unless ``saved`` ((name, bytes) as
        :meth:`named_tensors` names them) is this layout; before restored bytes are
        written."""
        ...
