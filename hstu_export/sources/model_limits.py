"""What a model itself allows, and where each limit comes from.

- Lengths: a model that describes its inputs (``input_schema()``, as the zoo's does) bounds each lengths
  feature itself. A schema stored in a bundle is not such a limit: it holds the ranges stated when the
  bundle was saved (``save_bundle(..., ranges=...)``), which ``--max-length`` may widen.
- The sequence the attention sees (contextual tokens + history + candidates): the ``max_seq_len`` of the
  model's configuration, where the model keeps one (the zoo's ``config``, generative-recommenders'
  ``DlrmHSTU._hstu_configs``, TorchEasyRec's ``DlrmHSTU._model_config``), and the rows of its positional
  tables (positions past the last row share it, so a longer sequence is not the model's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from hstu_export.package.schema import InputSchema

# Attributes where models keep their configuration (ours, generative-recommenders', TorchEasyRec's).
CONFIG_ATTRIBUTES = ("config", "_config", "hstu_configs", "_hstu_configs", "model_config", "_model_config")
POSITION_TABLE_WORD = "position"  # a 2-D parameter whose name holds it is a positional table


@dataclass(frozen=True)
class Limit:
    value: int
    source: str  # where the limit comes from, e.g. "DlrmHSTU._hstu_configs.max_seq_len"

    def __str__(self) -> str:
        return f"{self.value:,} ({self.source})"


def lengths_limits(model: nn.Module, stored_schema: InputSchema | None) -> dict[str, Limit]:
    """Each lengths feature's limit set by the model itself: its own ``input_schema()``'s maximum. None for
    a schema stored in the bundle (its maxima were stated, not the model's)."""
    own = getattr(model, "input_schema", None)
    if stored_schema is not None or not callable(own):
        return {}
    source = f"{type(model).__name__}.input_schema()"
    return {f.name: Limit(int(f.max_value), source) for f in own().lengths_features() if f.max_value is not None}


def sequence_limits(model: nn.Module) -> list[Limit]:
    """Limits on the longest sequence the model's attention may see, smallest first."""
    name = type(model).__name__
    limits = []
    seen: set[int] = set()  # a configuration its submodules share counts once, where it is found first
    for path, module in model.named_modules():  # a serving wrapper keeps the model (and its config) inside
        for attribute in CONFIG_ATTRIBUTES:
            config = module.__dict__.get(attribute)
            value = _int(getattr(config, "max_seq_len", None))
            if value is not None and id(config) not in seen:
                seen.add(id(config))
                limits.append(Limit(value, ".".join([name, *([path] if path else []), attribute, "max_seq_len"])))
    for path, parameter in model.named_parameters():
        if POSITION_TABLE_WORD in path.rpartition(".")[2].lower() and parameter.dim() == 2:
            limits.append(Limit(int(parameter.shape[0]), f"the positional table {path}, {parameter.shape[0]:,} rows"))
    return sorted(limits, key=lambda limit: limit.value)


def _int(value: Any) -> int | None:
    """A positive int (a protobuf field reads as one), else None."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        return None
    return int(value)
