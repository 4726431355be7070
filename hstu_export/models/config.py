"""Typed model configuration and the named presets of DESIGN.md."""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from typing import Any

from hstu_export.errors import ConfigError


@dataclass(frozen=True)
class HSTUConfig:
    """Everything that fixes an HSTU ranking model's shapes and semantics.

    Per-user sequence in the STU stack: ``contextual tokens ⊕ history ⊕ candidates``; candidates are the
    attention's targets. ``max_seq_len`` bounds that whole sequence and is the static padded size used
    wherever a graph must not depend on the batch's longest user.
    """

    embedding_dim: int = 32
    num_heads: int = 2
    attention_dim: int = 16  # Dqk
    linear_dim: int = 16  # Dv
    num_layers: int = 2
    max_history_len: int = 46
    max_num_candidates: int = 16
    contextual_features: tuple[str, ...] = ("user_id", "user_age")
    contextual_vocab_sizes: tuple[int, ...] = (1000, 10)
    item_vocab_size: int = 1000
    action_vocab_size: int = 16
    num_time_buckets: int = 64
    time_bucket_base: float = 0.301  # log-bucket width, as log(delta_seconds) / base
    scaling_seqlen: int = 0  # 0: use max_seq_len
    max_attn_len: int = 0
    alpha: float = 0.0  # 0: use 1 / sqrt(attention_dim)
    postprocessor: str = "layernorm"  # or "l2norm"
    task_names: tuple[str, ...] = ("ctr", "cvr")
    task_hidden_dims: tuple[int, ...] = (64,)
    kernel: str = "pytorch"  # hstu_export.ops.Kernel value

    def __post_init__(self) -> None:
        _check_field_types(self)
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            values = value if isinstance(value, tuple) else (value,)
            if hints.get(f.name) in (int, tuple[int, ...]) and values:
                floor = 0 if f.name in ZERO_ALLOWED else 1
                if min(values) < floor:
                    what = "integers" if isinstance(value, tuple) else "an integer"
                    shown = list(value) if isinstance(value, tuple) else value
                    raise ConfigError(f"model config {f.name!r}: expected {what} >= {floor}, got {_short(shown)}")
        if not 0 < self.time_bucket_base < math.inf:
            raise ConfigError(f"model config 'time_bucket_base': expected a number > 0, got {_short(self.time_bucket_base)}")
        if len(self.contextual_features) != len(self.contextual_vocab_sizes):
            raise ConfigError("model config: contextual_features and contextual_vocab_sizes differ in length")
        if self.postprocessor not in ("layernorm", "l2norm"):
            raise ConfigError(f"model config: postprocessor must be 'layernorm' or 'l2norm', got {self.postprocessor!r}")
        if not self.task_names:
            raise ConfigError("model config: at least one task name is needed")

    @property
    def contextual_seq_len(self) -> int:
        return len(self.contextual_features)

    @property
    def max_seq_len(self) -> int:
        return self.contextual_seq_len + self.max_history_len + self.max_num_candidates

    @property
    def attn_scaling_seqlen(self) -> int:
        return self.scaling_seqlen or self.max_seq_len

    @property
    def attn_alpha(self) -> float:
        return self.alpha or 1.0 / self.attention_dim**0.5

    def parameter_counts(self) -> dict[str, int]:
        """Parameters of the ranking model built from this config (``hstu_export.models.ranking``), by
        part, computed without building it: bundles refuse sizes the machine cannot hold before anything
        is allocated."""
        d, h = self.embedding_dim, self.num_heads
        uvqk = (2 * self.linear_dim + 2 * self.attention_dim) * h
        heads = 0
        for _ in self.task_names:
            width = d
            for hidden in (*self.task_hidden_dims, 1):
                heads += width * hidden + hidden
                width = hidden
        return {
            f"the item table (item_vocab_size {self.item_vocab_size:,} x embedding_dim {d:,})": self.item_vocab_size * d,
            "the action and contextual tables": (self.action_vocab_size + sum(self.contextual_vocab_sizes)) * d,
            "the preprocessor": (2 * d * d + d) + (d * d + d) + len(self.contextual_features) * (d * d + d),
            "the position and time tables": (self.max_seq_len + self.num_time_buckets) * d,
            f"the {self.num_layers:,} STU layers": self.num_layers * (
                2 * d + d * uvqk + uvqk + 2 * self.linear_dim * h + 3 * self.linear_dim * h * d),
            "the output norm": 2 * d,
            "the task heads": heads,
        }

    def to_dict(self) -> dict[str, Any]:
        return {f.name: (list(v) if isinstance(v := getattr(self, f.name), tuple) else v)
                for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HSTUConfig:
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ConfigError(f"model config has unknown keys {unknown}; was it written by a newer hstu-export?")
        values = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}
        return cls(**values)

    def replace(self, **changes: Any) -> HSTUConfig:
        return dataclasses.replace(self, **changes)


# Fields that may be 0 (meaning "derive it"); every other integer is a size >= 1.
ZERO_ALLOWED = ("scaling_seqlen", "max_attn_len")

# How a field's expected type is named in messages: (one value, a list of them).
_TYPE_WORDS = {int: ("an integer", "integers"), float: ("a number", "numbers"), str: ("a string", "strings"),
               bool: ("true or false", "booleans")}


def _check_field_types(config: Any) -> None:
    """Each field holds its annotated type (int, float, str, bool, tuple[X, ...]): a bundle's config is
    data from a file, and ``embedding_dim="abc"`` must fail here, naming the field."""
    hints = typing.get_type_hints(type(config))
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        hint = hints.get(f.name)
        if hint in _TYPE_WORDS and not _fits(hint, value):
            raise ConfigError(f"model config {f.name!r}: expected {_TYPE_WORDS[hint][0]}, got {_short(value)}")
        args = typing.get_args(hint)
        if typing.get_origin(hint) is tuple and len(args) == 2 and args[1] is Ellipsis and args[0] in _TYPE_WORDS:
            if not isinstance(value, tuple) or not all(_fits(args[0], v) for v in value):
                raise ConfigError(f"model config {f.name!r}: expected a list of {_TYPE_WORDS[args[0]][1]}, "
                                  f"got {_short(list(value) if isinstance(value, tuple) else value)}")


def _fits(kind: type, value: Any) -> bool:
    if kind is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


@dataclass(frozen=True)
class Preset:
    name: str
    config: HSTUConfig
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


# The reference configurations of DESIGN.md. "max seq" there bounds the whole per-user sequence.
PRESETS: dict[str, Preset] = {
    "tiny": Preset("tiny", HSTUConfig(), "CI"),
    "tzrec": Preset(
        "tzrec",
        HSTUConfig(
            embedding_dim=512, num_heads=4, attention_dim=128, linear_dim=128, num_layers=3,
            max_history_len=2046, max_num_candidates=2048, item_vocab_size=100_000,
            contextual_vocab_sizes=(100_000, 10), num_time_buckets=128, task_hidden_dims=(512, 256),
        ),
        "TorchEasyRec dlrm_hstu test config",
    ),
    "dlrmv3": Preset(
        "dlrmv3",
        HSTUConfig(
            embedding_dim=512, num_heads=4, attention_dim=128, linear_dim=128, num_layers=5,
            max_history_len=2048, max_num_candidates=2048, contextual_features=(), contextual_vocab_sizes=(),
            item_vocab_size=100_000, num_time_buckets=128, task_hidden_dims=(512, 256),
        ),
        "public H100 profile: B=32, mean history 1024, 2048 candidates/user, bf16",
    ),
}


def preset_config(name: str) -> HSTUConfig:
    try:
        return PRESETS[name].config
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}") from None
