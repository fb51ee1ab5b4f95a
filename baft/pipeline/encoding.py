"""Exact, pickle-free encoding of small training state: JSON with tagged values.

What :class:`~baft.pipeline.state.TrainingState` stores for state_dicts, hyperparameters
and records: floats keep their bits, tuples stay tuples, dict keys keep their types,
tensors and numpy arrays travel as raw bytes with dtype and shape. Nothing a peer wrote is
ever unpickled: decoding only builds the tagged types it knows.
"""

from __future__ import annotations

import base64
import json
import struct
from collections import Counter, OrderedDict
from typing import Any

import numpy as np
import torch
from torch.distributed.tensor import DTensor

_DTYPES = {
    str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)
}


def local(t: torch.Tensor) -> torch.Tensor:
    """The rank-local tensor of a (possibly DTensor) parameter or state."""
    return t.to_local() if isinstance(t, DTensor) else t


def typed_view(
    raw: torch.Tensor, dtype: torch.dtype, shape: torch.Size | tuple[int, ...]
) -> torch.Tensor:
    """``raw`` (uint8 bytes) read as a ``dtype`` tensor of ``shape``: a view when the
    bytes sit at an offset ``dtype`` can be viewed from, else a copy.

    Flat states and payloads lay tensors end to end without padding (the store slots,
    chunks and parity regions are byte ranges of that layout), so a tensor that follows
    one of odd size (``extra.optim.created`` holds a byte per deferred optimizer state; an
    fp16 tensor of odd numel) starts at an offset torch refuses to view as a wider type.
    Readers go through here instead of ``.view(dtype)``; only misaligned reads copy.
    """
    size = torch.empty((), dtype=dtype).element_size()
    if raw.storage_offset() % size or raw.data_ptr() % size:
        raw = raw.clone()
    return raw.view(dtype).view(shape)


def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = local(t).detach().cpu().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


# ---------------------------------------------------------------------- codec
def encode_value(obj: Any, where: str = "value") -> Any:
    """``obj`` as a JSON-able tree; every dict in the tree is a one-key type tag, so
    decoding is unambiguous. Raises ValueError naming ``where`` for unsupported types."""
    t = type(obj)
    if obj is None or t in (bool, int, str):
        return obj
    if t is float:  # exact bits, nan/inf/-0.0 included (JSON has none of them)
        return {"f": struct.pack(">d", obj).hex()}
    if t is list:
        return [encode_value(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    if t is tuple or t is torch.Size:
        return {
            "S" if t is torch.Size else "t": [
                encode_value(v, f"{where}[{i}]") for i, v in enumerate(obj)
            ]
        }
    if t is dict or t is OrderedDict:
        items = [
            [encode_value(k, f"{where} key"), encode_value(v, f"{where}[{k!r}]")]
            for k, v in obj.items()
        ]
        return {"o" if t is OrderedDict else "d": items}
    if t is Counter:  # MultiStepLR's milestones
        return {"c": [[encode_value(k, f"{where} key"), v] for k, v in obj.items()]}
    if t is torch.Tensor:  # exact type: a Parameter or DTensor would not come back as one
        if obj.is_sparse or obj.layout != torch.strided:
            raise ValueError(f"{where}: only dense tensors can be saved, got layout {obj.layout}")
        dtype = str(obj.dtype).removeprefix("torch.")
        return {"T": [dtype, list(obj.shape), _b64(_tensor_bytes(obj)), obj.device.type]}
    if t is bytes:
        return {"b": _b64(obj)}
    if isinstance(obj, np.ndarray) and t is np.ndarray:
        if obj.dtype.hasobject:
            raise ValueError(f"{where}: numpy arrays of Python objects cannot be saved")
        return {"N": [obj.dtype.str, list(obj.shape), _b64(np.ascontiguousarray(obj).tobytes())]}
    if isinstance(obj, np.generic) and not isinstance(obj, np.object_):
        return {"n": [obj.dtype.str, _b64(obj.tobytes())]}
    if t is torch.dtype:
        return {"dt": str(obj).removeprefix("torch.")}
    raise ValueError(
        f"{where}: values of type {t.__module__}.{t.__qualname__} cannot be saved "
        "(supported: None, bool, int, float, str, bytes, list, tuple, dict, OrderedDict, "
        "Counter, torch tensors, dtypes and sizes, numpy arrays and scalars)"
    )


def _decode_tensor(spec: list[Any], device: torch.device) -> torch.Tensor:
    name, shape, data, dev = spec
    dtype = _DTYPES.get(name)
    if dtype is None or not all(type(n) is int and n >= 0 for n in shape):
        raise ValueError(f"bad tensor record (dtype {name!r}, shape {shape!r})")
    raw = base64.b64decode(data, validate=True)
    numel = 1
    for n in shape:
        numel *= n
    if numel * dtype.itemsize != len(raw):
        raise ValueError(f"tensor record of {len(raw)} bytes does not hold {name}{shape}")
    out = torch.empty(shape, dtype=dtype)
    if raw:
        out.reshape(-1).view(torch.uint8).copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    return out.to(device) if dev == "cuda" and device.type == "cuda" else out


def decode_value(tree: Any, device: torch.device | None = None) -> Any:
    """Inverse of :func:`encode_value`; tensors saved from CUDA land on ``device`` when it
    is a CUDA device, on the CPU otherwise. Raises ValueError on malformed input."""
    dev = device or torch.device("cpu")
    if tree is None or type(tree) in (bool, int, str):
        return tree
    if type(tree) is list:
        return [decode_value(v, dev) for v in tree]
    if type(tree) is not dict or len(tree) != 1:
        raise ValueError(f"malformed state record: {str(tree)[:80]}")
    ((tag, v),) = tree.items()
    if tag == "f":
        return struct.unpack(">d", bytes.fromhex(v))[0]
    if tag in ("t", "S"):
        items = tuple(decode_value(x, dev) for x in v)
        return torch.Size(items) if tag == "S" else items
    if tag in ("d", "o"):
        pairs = [(decode_value(k, dev), decode_value(x, dev)) for k, x in v]
        return OrderedDict(pairs) if tag == "o" else dict(pairs)
    if tag == "c":
        return Counter({decode_value(k, dev): n for k, n in v})
    if tag == "T":
        return _decode_tensor(v, dev)
    if tag == "b":
        return base64.b64decode(v, validate=True)
    if tag == "N":
        dt = np.dtype(v[0])
        if dt.hasobject:
            raise ValueError("numpy object arrays are not accepted")
        return np.frombuffer(base64.b64decode(v[2], validate=True), dtype=dt).reshape(v[1]).copy()
    if tag == "n":
        dt = np.dtype(v[0])
        if dt.hasobject:
            raise ValueError("numpy object scalars are not accepted")
        return np.frombuffer(base64.b64decode(v[1], validate=True), dtype=dt)[0]
    if tag == "dt" and v in _DTYPES:
        return _DTYPES[v]
    raise ValueError(f"unknown state record tag {tag!r}")


def encode_blob(obj: Any, where: str) -> bytes:
    """``obj`` as compact JSON bytes (see :func:`encode_value`)."""
    tree = encode_value(obj, where)
    return json.dumps(tree, separators=(",", ":"), allow_nan=False).encode()


def decode_blob(data: bytes, device: torch.device | None = None) -> Any:
    """Inverse of :func:`encode_blob`; ValueError on anything malformed."""
    try:
        tree = json.loads(data.decode())
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"state record is not valid JSON: {e}") from e
    try:
        return decode_value(tree, device)
    except (TypeError, KeyError, IndexError, RecursionError, struct.error) as e:
        raise ValueError(f"malformed state record: {e!r}") from e


# ---------------------------------------------------------------------- hyperparameters
