"""The one device-copy seam: live tensors (CPU or CUDA) -> host snapshot buffers.

On CPU a snapshot copy is a plain ``copy_`` (memcpy). On CUDA it is issued on a side
stream with ``non_blocking=True`` into host memory that was registered (pinned) once,
and ``synchronize()`` waits on an event recorded after the last copy, so SNAPSHOT tasks
queue DMA work without stalling the compute stream. Everything else in the engine works
on host bytes and never asks which device the model is on.
"""

from __future__ import annotations

from typing import Protocol

import torch


class DeviceCopy(Protocol):
    """Copies device bytes into host buffers; ``synchronize`` makes them visible."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None: ...

    def synchronize(self) -> None: ...


class HostCopy:
    """CPU tensors: a synchronous memcpy."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def synchronize(self) -> None:
        return None


class CudaCopy:
    """CUDA tensors: asynchronous D2H copies on a side stream, ordered after compute."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device=device)
        self.event = torch.cuda.Event()
        self.device = device

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        # The side stream must see every kernel that produced ``src`` so far.
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
        self.event.record(self.stream)

    def synchronize(self) -> None:
        self.event.synchronize()


def pin_host_buffer(t: torch.Tensor) -> None:
    """Register a shared-memory host buffer with CUDA (no-op on CPU-only machines)."""
    if torch.cuda.is_available() and t.numel():
        torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)


def device_copy_for(device: torch.device) -> DeviceCopy:
    return CudaCopy(device) if device.type == "cuda" else HostCopy()
