"""The one table of dtype names: plans, job files, hardware files, the command line, safetensors
files and the tensor header all name dtypes from here.

Names are torch's own (``"bfloat16"`` is ``torch.bfloat16``). torch is imported only when a name
is turned into a ``torch.dtype`` (:func:`torch_dtype`), so the plan layer and the command line's
flag checks stay free of it.

>>> FLOATING
('float32', 'bfloat16', 'float16')
>>> torch_dtype("bfloat16")
torch.bfloat16
>>> dtype_name(torch_dtype("float16")), SAFETENSORS["BF16"]
('float16', 'bfloat16')
>>> torch_dtype("half")
Traceback (most recent call last):
    ...
shardkit.plan.errors.UsageError: dtype 'half' is unknown; valid: float32, bfloat16, float16
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .errors import UsageError

if TYPE_CHECKING:
    import torch

#: The floating dtypes a plan computes and reduces in (``FSDPOptions.param_dtype`` /
#: ``reduce_dtype``), that a :class:`~shardkit.planner.hardware.Hardware` gives a peak for, and
#: that a checkpoint converts to.
FLOATING = ("float32", "bfloat16", "float16")
#: safetensors' dtype codes and torch's names for them (float8 only where torch has it:
#: :func:`available`).
SAFETENSORS = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
               "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
               "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
#: The dtypes a tensor header names, by index (:mod:`shardkit.runtime.tensor_header`): a wire
#: format, so only ever appended to.
HEADER = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
          "complex64", "complex128")


def torch_dtype(name: str, valid: Sequence[str] = FLOATING) -> torch.dtype:
    """The ``torch.dtype`` named ``name``, one of ``valid``; :class:`UsageError` listing them."""
    import torch

    dtype = getattr(torch, name, None) if name in valid else None
    if not isinstance(dtype, torch.dtype):
        raise UsageError(f"dtype {name!r} is unknown; valid: {', '.join(valid)}")
    return dtype


def dtype_name(dtype: Any) -> str:
    """The name of a ``torch.dtype`` (``torch.bfloat16`` -> ``"bfloat16"``); a name is returned as is."""
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")


def available(names: Sequence[str]) -> list[str]:
    """Those of ``names`` this torch has (float8 dtypes came in torch 2.1)."""
    import torch

    return [name for name in names if isinstance(getattr(torch, name, None), torch.dtype)]


__all__ = ["FLOATING", "HEADER", "SAFETENSORS", "available", "dtype_name", "torch_dtype"]
