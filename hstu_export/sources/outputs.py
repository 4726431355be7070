"""Naming a model's outputs: whatever structure ``forward`` returns becomes a flat dict of named tensors.

A dict keeps its keys, a namedtuple or a dataclass gives its field names (as a dict would its keys), a
tuple or list gives ``output_<i>`` at the top level and ``<parent>.<i>`` below, nested containers join
names with ``.``, a lone tensor is ``output``. ``None`` (an optional output a model leaves empty at
inference) and empty containers give no entry. The traced graph and the eager model are flattened by the
same rule, so verification compares the same names. What a package finally calls its outputs (renamed,
one per task) is :mod:`hstu_export.sources.output_plan`'s, applied after this flattening.
"""

from __future__ import annotations

import dataclasses
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
        elif isinstance(x, dict) or (fields := named_fields(x)) is not None:
            for k, v in (x.items() if isinstance(x, dict) else fields):
                visit(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(x, (tuple, list)):
            for i, v in enumerate(x):
                visit(f"{prefix}.{i}" if prefix else f"output_{i}", v)
        else:
            items.append((prefix or SINGLE_OUTPUT, x))

    visit("", value)
    return items


def named_fields(value: Any) -> list[tuple[str, Any]] | None:
    """(field, value) pairs of a namedtuple or dataclass instance; None for anything else."""
    if isinstance(value, tuple) and isinstance(getattr(type(value), "_fields", None), tuple):
        return list(zip(type(value)._fields, value))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [(f.name, getattr(value, f.name)) for f in dataclasses.fields(value)]
    return None


def flatten_outputs(value: Any) -> dict[str, Tensor]:
    """The model's outputs as ``{name: tensor}``; non-tensor leaves (ints, strings) are left out."""
    return {name: v for name, v in output_items(value) if isinstance(v, Tensor)}


def call_model(model: Any, schema: Any, batch: dict[str, Tensor], plan: Any = None) -> dict[str, Tensor]:
    """What the user's model returns for a flat request: ``model`` called with the arguments the input
    schema assembles (real KeyedJaggedTensors, dicts, tensors), its outputs flattened by name, then named
    as a package names them when ``plan`` (an ``OutputPlan``: ``hstu_export.load(pkg).output_plan``) is
    given."""
    args, kwargs = schema.assemble(batch)
    flat = flatten_outputs(model(*args, **kwargs))
    return plan.apply(flat) if plan is not None else flat
