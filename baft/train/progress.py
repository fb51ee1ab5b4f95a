"""Progress display for rank 0: a rich bar on a terminal, a line every few iterations otherwise."""

from __future__ import annotations

import sys

from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
from rich.progress import Progress as RichProgress


class Progress:
    """Iteration progress with the latest loss and iteration time."""

    def __init__(self, total: int, *, enabled: bool, every: int = 10) -> None:
        self.total = total
        self.enabled = enabled
        self.every = every
        self._bar: RichProgress | None = None
        if enabled and sys.stdout.isatty():
            self._bar = RichProgress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[status]}"),
                TimeRemainingColumn(),
            )
            self._task = self._bar.add_task("train", total=total, status="")
            self._bar.start()

    def update(self, done: int, loss: float, iter_s: float) -> None:
        if not self.enabled:
            return
        status = f"loss {loss:.4f}  {iter_s * 1000:.0f} ms/it"
        if self._bar is not None:
            self._bar.update(self._task, completed=done, status=status)
        elif done == 1 or done % self.every == 0 or done == self.total:
            print(f"[baft] iteration {done}/{self.total}  {status}", flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
