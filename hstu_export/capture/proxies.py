"""FX proxies that know what real HSTU code needs to know while it is traced.

Real model code asks a KeyedJaggedTensor for its keys and loops over them, concatenates the keys of
two of them, reads one key's values or lengths, and iterates over what an embedding module returned.
A plain ``torch.fx.Proxy`` makes each of those a graph node whose value is unknown, so the first
``for key in kjt.keys()`` fails. These proxies keep what is static (the keys, known from the input
schema or the embedding module's config) as Python values and still record every tensor access:

- :class:`InputKJTProxy`: a model argument assembled from flat request tensors. ``kjt[key].values()``
  is the request tensor itself (no KJT op in the graph), ``kjt.values()`` their concatenation; other
  methods are recorded on the KeyedJaggedTensor the graph builds (``build_kjt``).
- :class:`InputJTProxy`: a JaggedTensor of the input (one key of an input KJT, or a JaggedTensor
  argument or record field): its values, lengths and weights are the request tensors themselves.
- :class:`InputKTProxy`: a KeyedTensor of the input: ``kt[key]`` and ``kt.to_dict()`` are the request
  tensors, ``kt.values()`` their concatenation, ``length_per_key()`` known ints.
- :class:`KJTProxy`: a KeyedJaggedTensor the model builds itself with known keys.
- :class:`KeyedProxy`: an embedding module's output with known keys (a dict of JaggedTensors from
  an EmbeddingCollection, a KeyedTensor from an EmbeddingBagCollection).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx

# KeyedJaggedTensor methods that return a KeyedJaggedTensor with the same keys.
_SAME_KEYS_METHODS = frozenset({"sync", "to", "pin_memory", "record_stream", "detach", "unsync"})


class KJTProxy(torch.fx.Proxy):
    """A KeyedJaggedTensor in the graph whose keys are known while tracing."""

    def __init__(self, node: torch.fx.Node, tracer: Any, keys: list[str]) -> None:
        super().__init__(node, tracer)
        self._keys = list(keys)

    def keys(self) -> list[str]:
        return list(self._keys)

    def __len__(self) -> int:
        raise TypeError("len() of a KeyedJaggedTensor is not defined; use len(kjt.keys())")


class InputJTProxy(torch.fx.Proxy):
    """A JaggedTensor of the input (``kjt[key]`` of an input KJT, or one assembled from a JaggedTensor's
    request tensors): values/lengths/weights are the request tensors themselves."""

    def __init__(self, node: torch.fx.Node, tracer: Any, values: Any, lengths: Any, weights: Any) -> None:
        super().__init__(node, tracer)
        self._values, self._lengths, self._weights = values, lengths, weights

    def values(self) -> Any:
        return self._values

    def lengths(self) -> Any:
        return self._lengths

    def lengths_or_none(self) -> Any:
        return self._lengths

    def weights(self) -> Any:
        if self._weights is None:
            raise ValueError("this KeyedJaggedTensor has no weights")
        return self._weights

    def weights_or_none(self) -> Any:
        return self._weights

    def offsets(self) -> Any:
        return _offsets(self._lengths)


class InputKJTProxy(KJTProxy):
    """A model argument assembled from flat request tensors (one values/lengths pair per key)."""

    def __init__(self, node: torch.fx.Node, tracer: Any, keys: list[str], values: list[Any],
                 lengths: list[Any], weights: list[Any] | None) -> None:
        super().__init__(node, tracer, keys)
        self._per_key_values, self._per_key_lengths, self._per_key_weights = values, lengths, weights

    def _cat(self, parts: list[Any]) -> Any:
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def values(self) -> Any:
        return self._cat(self._per_key_values)

    def lengths(self) -> Any:
        return self._cat(self._per_key_lengths)

    def lengths_or_none(self) -> Any:
        return self.lengths()

    def weights(self) -> Any:
        if self._per_key_weights is None:
            raise ValueError("this KeyedJaggedTensor has no weights")
        return self._cat(self._per_key_weights)

    def weights_or_none(self) -> Any:
        return None if self._per_key_weights is None else self.weights()

    def offsets(self) -> Any:
        return _offsets(self.lengths())

    def stride(self) -> Any:
        return self._per_key_lengths[0].size(0)

    def length_per_key(self) -> list[Any]:
        return [lengths.sum() for lengths in self._per_key_lengths]

    def __getitem__(self, key: Any) -> Any:
        if not isinstance(key, str) or key not in self._keys:
            raise KeyError(f"{key!r} is not a key of this KeyedJaggedTensor (keys: {self._keys})")
        i = self._keys.index(key)
        node = self.tracer.create_node("call_function", operator.getitem, (self.node, key), {})
        weights = None if self._per_key_weights is None else self._per_key_weights[i]
        return InputJTProxy(node, self.tracer, self._per_key_values[i], self._per_key_lengths[i], weights)

    def to_dict(self) -> dict[str, Any]:
        return {key: self[key] for key in self._keys}


class InputKTProxy(torch.fx.Proxy):
    """A KeyedTensor (key dim 1) assembled from per-key request tensors ``[B, dim]``."""

    def __init__(self, node: torch.fx.Node, tracer: Any, keys: list[str], tensors: list[Any],
                 dims: list[int]) -> None:
        super().__init__(node, tracer)
        self._keys, self._tensors, self._dims = list(keys), list(tensors), list(dims)

    def keys(self) -> list[str]:
        return list(self._keys)

    def key_dim(self) -> int:
        return 1

    def length_per_key(self) -> list[int]:
        return list(self._dims)

    def offset_per_key(self) -> list[int]:
        offsets = [0]
        for dim in self._dims:
            offsets.append(offsets[-1] + dim)
        return offsets

    def values(self) -> Any:
        return self._tensors[0] if len(self._tensors) == 1 else torch.cat(self._tensors, dim=1)

    def __getitem__(self, key: Any) -> Any:
        if not isinstance(key, str) or key not in self._keys:
            raise KeyError(f"{key!r} is not a key of this KeyedTensor (keys: {self._keys})")
        return self._tensors[self._keys.index(key)]

    def to_dict(self) -> dict[str, Any]:
        return dict(zip(self._keys, self._tensors))


class KeyedProxy(torch.fx.Proxy):
    """An embedding module's output with known keys: ``kind`` "dict" (EmbeddingCollection's
    ``Dict[str, JaggedTensor]``) or "kt" (EmbeddingBagCollection's KeyedTensor)."""

    def __init__(self, node: torch.fx.Node, tracer: Any, keys: list[str], kind: str) -> None:
        super().__init__(node, tracer)
        self._keys, self._kind = list(keys), kind

    def keys(self) -> list[str]:
        return list(self._keys)

    def __iter__(self) -> Any:
        if self._kind == "dict":
            return iter(self._keys)
        return super().__iter__()

    def __len__(self) -> int:
        if self._kind == "dict":
            return len(self._keys)
        raise TypeError("len() of a KeyedTensor is not defined")

    def __contains__(self, key: Any) -> bool:
        return key in self._keys

    def items(self) -> list[tuple[str, Any]]:
        if self._kind != "dict":
            raise AttributeError("a KeyedTensor has no items(); use to_dict().items()")
        return [(key, self[key]) for key in self._keys]

    def values(self) -> Any:
        if self._kind == "dict":
            return [self[key] for key in self._keys]
        return self.tracer.create_proxy("call_method", "values", (self,), {})

    def to_dict(self) -> dict[str, Any]:
        return {key: self[key] for key in self._keys}

    def get(self, key: str, default: Any = None) -> Any:
        return self[key] if key in self._keys else default


def _offsets(lengths: Any) -> Any:
    # torchrec's offsets keep the lengths' dtype (fbgemm's complete cumsum); cumsum alone widens int32.
    return torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0)).to(lengths.dtype)


def kjt_proxy_factory(tracer: Any, kind: str, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A proxy factory for ``Tracer.create_proxy``: KeyedJaggedTensors built with literal keys, and
    same-key methods of known KJTs, keep their keys."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    keys: list[str] | None = None
    if kind == "call_function" and target is KeyedJaggedTensor:
        given = kwargs.get("keys", args[0] if args else None)
        if isinstance(given, (list, tuple)) and all(isinstance(k, str) for k in given):
            keys = list(given)
    elif kind == "call_method" and target in _SAME_KEYS_METHODS and args and isinstance(args[0], KJTProxy):
        keys = args[0].keys()
    if keys is None:
        return None
    return lambda node: KJTProxy(node, tracer, keys)


def embedding_output_keys(module: torch.nn.Module) -> tuple[str, list[str]] | None:
    """(kind, keys) of what a torchrec embedding module returns, from its config; None if unknown."""
    names_by_table = getattr(module, "embedding_names_by_table", None)
    if callable(names_by_table) and hasattr(module, "embedding_configs"):  # EmbeddingCollection
        return "dict", [name for names in names_by_table() for name in names]
    embedding_names = getattr(module, "_embedding_names", None)
    if isinstance(embedding_names, list) and all(isinstance(n, str) for n in embedding_names):
        return "kt", list(embedding_names)
    return None
