"""Memory per mode and rank for ``baft bench overhead``.

- **Host RSS peak** over a mode's blocks: Linux keeps a process's high-water mark
  (``VmHWM`` in ``/proc/self/status``); writing ``5`` to ``/proc/self/clear_refs`` resets it
  to the current RSS. The tracker resets it when a mode is switched on and reads it when
  the mode is switched off (after its background work drained), so each mode's peak
  covers its own blocks only (``method: "vmhwm"``). Where the reset is refused it falls
  back to the largest ``VmRSS`` sampled at the end of the mode's blocks
  (``method: "vmrss-at-block-end"``: it misses peaks inside a block). RSS is the whole
  process's: every mode's buffers that stay allocated (stores, pinned copies, records)
  count in every mode's peak, so the tracker also reports ``rss_held_bytes``, what RSS
  grew by while the mode was built and warmed up (its standing buffers).
- **Shared memory** held by a mode: the allocated bytes of its files under ``/dev/shm``
  (baft's stores, DLRover's segments).
- **Device memory** (CUDA): ``torch.cuda.max_memory_allocated``, reset when a mode is
  switched on; None on CPU.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

CLEAR_REFS = Path("/proc/self/clear_refs")
STATUS = Path("/proc/self/status")


def _status_kib(field: str) -> int:
    for line in STATUS.read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in {STATUS}")


def rss_bytes() -> int:
    """The process's resident set now (``VmRSS``)."""
    return _status_kib("VmRSS") * 1024


def rss_peak_bytes() -> int:
    """The process's resident high-water mark (``VmHWM``)."""
    return _status_kib("VmHWM") * 1024


def reset_rss_peak() -> bool:
    """Reset ``VmHWM`` to the current RSS; False when the kernel refuses."""
    try:
        CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True


def allocated_bytes(paths: Iterable[Path]) -> int:
    """Bytes allocated to the files under ``paths`` (files or directories, recursively):
    what a shared-memory file holds, not its apparent size."""
    total = 0
    for path in paths:
        files = [path] if path.is_file() else (p for p in path.rglob("*") if p.is_file())
        for f in files:
            try:
                total += f.stat().st_blocks * 512
            except OSError:  # removed meanwhile
                pass
    return total


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.is_initialized()


class MemoryTracker:
    """Per-mode memory of one rank (see the module docstring)."""

    def __init__(self) -> None:
        self.method = "vmhwm" if reset_rss_peak() else "vmrss-at-block-end"
        self.rss_peak: dict[str, int] = {}
        self.rss_held: dict[str, int] = {}
        self.cuda_peak: dict[str, int] = {}
        self._held_from: dict[str, int] = {}

    def held_start(self, mode: str) -> None:
        """Before ``mode`` allocates its standing buffers (its build, its warm-up)."""
        self._held_from[mode] = rss_bytes()

    def held_stop(self, mode: str) -> None:
        """After them: the growth is added to ``rss_held[mode]``."""
        grown = max(rss_bytes() - self._held_from.pop(mode, rss_bytes()), 0)
        self.rss_held[mode] = self.rss_held.get(mode, 0) + grown

    def switched_on(self, mode: str) -> None:
        if self.method == "vmhwm":
            reset_rss_peak()
        if _cuda():
            import torch

            torch.cuda.reset_peak_memory_stats()

    def switched_off(self, mode: str) -> None:
        peak = rss_peak_bytes() if self.method == "vmhwm" else rss_bytes()
        self.rss_peak[mode] = max(self.rss_peak.get(mode, 0), peak)
        if _cuda():
            import torch

            used = int(torch.cuda.max_memory_allocated())
            self.cuda_peak[mode] = max(self.cuda_peak.get(mode, 0), used)

    def mode_memory(self, mode: str, shm_bytes: int, record_bytes: int | None) -> dict:
        """This rank's memory of ``mode`` (one entry per field; gathered over ranks)."""
        return {
            "rss_peak_bytes": self.rss_peak.get(mode),
            "rss_held_bytes": self.rss_held.get(mode),
            "shm_bytes": shm_bytes,
            "cuda_peak_bytes": self.cuda_peak.get(mode) if _cuda() else None,
            "record_bytes": record_bytes,
        }


def per_rank(rows: list[dict]) -> dict:
    """``{field: [value per rank]}`` from each rank's :meth:`MemoryTracker.mode_memory`;
    ``cuda_peak_bytes`` and ``record_bytes`` are None when no rank has a value."""
    fields = rows[0].keys() if rows else ()
    out: dict = {f: [r[f] for r in rows] for f in fields}
    for f in ("cuda_peak_bytes", "record_bytes"):
        if f in out and all(v is None for v in out[f]):
            out[f] = None
    return out
