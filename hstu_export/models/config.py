"""Typed model configuration and the named presets of DESIGN.md."""

from __future__ import annotations

import dataclasses
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
        for name in ("embedding_dim", "num_heads", "attention_dim", "linear_dim", "num_layers",
                     "max_history_len", "max_num_candidates", "item_vocab_size", "action_vocab_size",
                     "num_time_buckets"):
            if int(getattr(self, name)) < 1:
                raise ConfigError(f"model config: {name} must be >= 1, got {getattr(self, name)}")
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
