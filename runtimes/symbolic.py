"""``int()`` and ``float()`` of traced values as torch.export can trace them (symbolic, never a number
read from tensor data), and the non-negativity a size read from data needs."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def symbolic_int(value: Any) -> Any:
    """``int(value)`` as torch.export can trace it: a symbolic int stays symbolic (``int()`` of an
    unbacked size would demand its value), an integer tensor becomes its (unbacked) item."""
    if isinstance(value, torch.SymInt):
        return value
    if isinstance(value, Tensor):
        item = value.item()
        return item if not value.is_floating_point() else torch.sym_int(item)
    if isinstance(value, torch.SymFloat):
        return torch.sym_int(value)
    return int(value)


def symbolic_float(value: Any) -> Any:
    if isinstance(value, (torch.SymInt, torch.SymFloat)):
        return torch.sym_float(value)
    if isinstance(value, Tensor):
        return torch.sym_float(value.item())
    return float(value)


def check_non_negative(value: Any) -> Any:
    """``value``, known to be >= 0 from here on (a size computed from data, say a max length)."""
    torch._check(value >= 0)
    return value
