"""Functions that stay single call nodes in FX graphs.

Two kinds live here:
- markers (``sparse_boundary``) that name the sparse→dense boundary and survive tracing as nodes the
  split pass cuts at;
- small helpers whose bodies cannot be symbolically traced (they build a KeyedJaggedTensor), so FX
  records a call instead of stepping into them.

(Token positions inside jagged sequences are the ``hstu_export::jagged_positions`` op, not a helper here, so
that the mapping pass can pick their implementation per target.)

The tracer auto-wraps every function in ``WRAPPED_FUNCTIONS`` wherever a module's forward calls it, so
models may import these by name. Keep them TorchScript-compatible (type hints, no closures): the sparse
graph is scripted.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


def sparse_boundary(value: Tensor, name: str, jagged_by: str = "") -> Tensor:
    """Identity that marks ``value`` as a tensor crossing from the sparse to the dense part.

    ``name`` becomes the dense graph's input name; ``jagged_by`` names the model input holding the
    per-user lengths that partition ``value``'s first dim ("" for a dense per-user tensor [B, ...]).
    """
    return value


def build_kjt(keys: list[str], values: list[Tensor], lengths: list[Tensor]) -> KeyedJaggedTensor:
    """KeyedJaggedTensor from per-key values and lengths (every key has one length per user)."""
    return KeyedJaggedTensor(keys=keys, values=torch.cat(values), lengths=torch.cat(lengths))


def per_user_as_jagged(value: Tensor) -> Tensor:
    """Per-user ids ``[B]`` as jagged values with length 1 each: ``[B]`` -> lengths ``[B]`` of ones."""
    return torch.ones_like(value)


WRAPPED_FUNCTIONS: tuple[Callable[..., object], ...] = (
    sparse_boundary,
    build_kjt,
    per_user_as_jagged,
)

for _fn in WRAPPED_FUNCTIONS:
    torch.fx.wrap(_fn.__name__)
