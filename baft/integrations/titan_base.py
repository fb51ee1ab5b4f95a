"""The base class ``BaftCheckpointManager`` derives from: torchtitan's own when installed.

torchtitan's ``BaseCheckpointManager`` (``torchtitan/components/checkpointer/base.py``,
torchtitan 0.3.0, tested in baft's dev environment) is a ``Configurable``: its subclasses
declare a nested ``Config`` dataclass (``kw_only``, ``slots``), and ``Config.build(**kw)``
constructs the class that declared it. Its public methods check ``enable`` and dispatch to
the ``_``-prefixed hooks a manager implements (``_load``, ``_save``,
``_maybe_wait_for_staging``, ``_wait_for_saving``, ``_close``).

Without torchtitan, :class:`StandInCheckpointManager` restates that contract (the same
public methods, hooks, the ``Config`` fields baft reads, with torchtitan's defaults, and
``build``), so that ``baft.integrations.torchtitan`` imports and works in a loop written
in torchtitan's shape. With torchtitan installed, :data:`BaseManager` is torchtitan's class
and the stand-in is unused.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, ClassVar

__all__ = ["TORCHTITAN_AVAILABLE", "BaseManager", "StandInCheckpointManager"]


class StandInCheckpointManager(ABC):
    """torchtitan's ``BaseCheckpointManager`` contract, for use without torchtitan."""

    enable: bool
    save_future: Any
    folder: str
    keep_latest_k: int

    @dataclass(kw_only=True, slots=True)
    class Config:
        """The fields of torchtitan's ``BaseCheckpointManager.Config`` baft reads."""

        _owner: ClassVar[type | None] = None
        enable: bool = False
        folder: str = "checkpoint"
        interval: int = 500
        initial_load_path: str | None = None
        last_save_in_hf: bool = False
        keep_latest_k: int = 10
        load_step: int = -1
        exclude_from_loading: list[str] = field(default_factory=list)
        create_seed_checkpoint: bool = False
        load_only: bool = False

        def build(self, **kwargs: Any) -> Any:
            """Construct the manager class that declared this ``Config`` (as torchtitan)."""
            if self._owner is None:
                raise NotImplementedError(f"{type(self).__name__} has no owner class")
            return self._owner(config=replace(self), **kwargs)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        config = cls.__dict__.get("Config")
        if config is not None:
            config._owner = cls  # torchtitan's Configurable wires build() the same way

    def load(self, step: int = -1) -> bool:
        return self._load(step) if self.enable else False

    def save(self, curr_step: int, last_step: bool = False) -> bool:
        return self._save(curr_step, last_step) if self.enable else False

    def maybe_wait_for_staging(self) -> None:
        if self.enable:
            self._maybe_wait_for_staging()

    def close(self) -> None:
        if getattr(self, "enable", False):
            self._close()

    def maybe_wait_for_saving(self) -> None:
        if self.enable and self.save_future is not None:
            self._wait_for_saving()

    @abstractmethod
    def _wait_for_saving(self) -> None: ...

    @abstractmethod
    def _load(self, step: int = -1) -> bool: ...

    @abstractmethod
    def _save(self, curr_step: int, last_step: bool = False) -> bool: ...

    @abstractmethod
    def _maybe_wait_for_staging(self) -> None: ...

    @abstractmethod
    def _close(self) -> None: ...


if TYPE_CHECKING:  # type-check against the stand-in: torchtitan is no runtime dependency
    BaseManager = StandInCheckpointManager
    TORCHTITAN_AVAILABLE: bool
else:
    try:
        from torchtitan.components.checkpointer import BaseCheckpointManager as BaseManager

        TORCHTITAN_AVAILABLE = True
    except ModuleNotFoundError as e:  # torchtitan absent; a broken install still raises
        if e.name != "torchtitan":
            raise
        BaseManager = StandInCheckpointManager
        TORCHTITAN_AVAILABLE = False
