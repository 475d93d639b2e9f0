"""Numbers as users pass them: a Python or numpy scalar, or a 0-d tensor, where torch takes a float or an int."""

from __future__ import annotations

import numbers
from typing import Any

import torch

__all__ = ["real_number", "int_number", "as_float", "check_bool", "PLAIN"]

# values compared by value, not identity (a graph's key, a loss function's plain arguments)
PLAIN = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device)


def real_number(x: Any) -> float | None:
    """``x`` as a Python float when it is one real number (a Python or numpy scalar, a 0-d real tensor: read on
    the host, at construction); None otherwise. A bool is not a number here."""
    if isinstance(x, torch.Tensor):
        if x.dim() == 0 and (x.is_floating_point() or x.dtype in _INTS):
            return float(x.item())  # HOST SYNC (arguments only)
        return None
    if isinstance(x, numbers.Real) and not isinstance(x, bool):
        return float(x)
    return None


def as_float(x: float | torch.Tensor) -> float:
    """A Python float or a one-element tensor (an optimizer's ``lr`` may be either) as a Python float; a tensor is
    read on the host."""
    return float(x) if not isinstance(x, torch.Tensor) else float(x.detach().cpu())  # HOST SYNC (a tensor lr only)


def check_bool(name: str, value: Any) -> bool:
    """``value`` as a bool (a numpy bool or a 0-d bool tensor included), or a ValueError naming ``name``: a flag read
    by truthiness took ``"no"`` or ``"False"`` as True, unsaid (an audit)."""
    item = value.item() if hasattr(value, "item") and getattr(value, "shape", None) == () else value
    if not isinstance(item, bool):
        raise ValueError(f"Expected {name} to be a bool, but got {value!r}")
    return item


def int_number(x: Any) -> int | None:
    """``x`` as a Python int when it is one integer (a Python or numpy integer, a 0-d integer tensor); None
    otherwise (a bool, a float that happens to be whole)."""
    if isinstance(x, torch.Tensor):
        return int(x.item()) if x.dim() == 0 and x.dtype in _INTS else None
    if isinstance(x, numbers.Integral) and not isinstance(x, bool):
        return int(x)
    return None


_INTS = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
