"""Naming a model's outputs: whatever structure ``forward`` returns becomes a flat dict of named tensors.

A dict keeps its keys, a tuple or list gives ``output_<i>`` at the top level and ``<parent>.<i>`` below,
nested dicts join keys with ``.``, a lone tensor is ``output``. ``None`` (an optional output a model
leaves empty at inference) and empty containers give no entry. The traced graph and the eager model
are flattened by the same rule, so verification compares the same names.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

SINGLE_OUTPUT = "output"


def output_items(value: Any, is_leaf: Any = None) -> list[tuple[str, Any]]:
    """(name, leaf) pairs of ``value``; ``is_leaf(x)`` says what counts as a leaf (default: tensors)."""
    leaf = is_leaf or (lambda x: isinstance(x, Tensor))
    if leaf(value):
        return [(SINGLE_OUTPUT, value)]
    items: list[tuple[str, Any]] = []

    def visit(prefix: str, x: Any) -> None:
        if x is None:
            return
        if leaf(x):
            items.append((prefix, x))
        elif isinstance(x, dict):
            for k, v in x.items():
                visit(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(x, (tuple, list)):
            for i, v in enumerate(x):
                visit(f"{prefix}.{i}" if prefix else f"output_{i}", v)
        else:
            items.append((prefix or SINGLE_OUTPUT, x))

    visit("", value)
    return items


def flatten_outputs(value: Any) -> dict[str, Tensor]:
    """The model's outputs as ``{name: tensor}``; non-tensor leaves (ints, strings) are left out."""
    return {name: v for name, v in output_items(value) if isinstance(v, Tensor)}


def call_model(model: Any, schema: Any, batch: dict[str, Tensor]) -> dict[str, Tensor]:
    """What the user's model returns for a flat request: ``model`` called with the arguments the input
    schema assembles (real KeyedJaggedTensors, dicts, tensors), its outputs flattened by name."""
    args, kwargs = schema.assemble(batch)
    return flatten_outputs(model(*args, **kwargs))
