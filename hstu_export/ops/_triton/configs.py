"""Deterministic launch configurations for the Triton kernels.

Inductor rejects autotune configs that carry a ``pre_hook`` and an AOTInductor package must not
autotune at load time, so each kernel gets exactly one config, looked up in a small table keyed by
(GPU compute capability, padded head dims, dtype). The table is data; the lookup is a pure function
of its key, so an export on a given GPU always compiles the same kernels. ``chosen_configs()``
returns every config looked up in this process; ``collecting_configs()`` those looked up inside a
block (one export's compile), for that package's manifest.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from collections.abc import Iterator

import torch

__all__ = [
    "AttentionConfig",
    "JaggedConfig",
    "attention_config",
    "chosen_configs",
    "collecting_configs",
    "dot_precision",
    "gate_config",
    "jagged_config",
    "next_power_of_2",
]


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Tile shape and launch parameters of the HSTU attention kernel."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


@dataclasses.dataclass(frozen=True)
class JaggedConfig:
    """Tile shape of the jagged copy kernels (rows x features)."""

    block_rows: int
    block_d: int
    num_warps: int


def dot_precision(dtype: torch.dtype) -> str:
    """How a kernel's products of ``dtype`` operands run (``tl.dot``'s ``input_precision``): fp32 operands as
    torch's own fp32 products do, by ``torch.get_float32_matmul_precision()``: ``"ieee"`` (full fp32) at its default
    ``"highest"``, TF32 (10-bit mantissas) at ``"high"`` or ``"medium"``. Read when the kernel is launched or traced,
    so an exported program keeps the precision of the export. 16-bit operands: ``"tf32"``, which does not apply to
    them (their compiled kernels are unchanged)."""
    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return "ieee"
    return "tf32"


def next_power_of_2(x: int) -> int:
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


# Key: (capability or "interpreter"/"default", dtype class) -> rows (largest padded head dim,
# config). The dtype class is "16bit" (fp16/bf16) or "fp32"; the first row whose bound fits
# max(next_power_of_2(Dqk), next_power_of_2(Dv)) is taken.
_ATTENTION_TABLE: dict[tuple[object, str], tuple[tuple[int, AttentionConfig], ...]] = {
    # Hopper: the fastest of the candidates timed on an H100 by benchmarks/attention.py --sweep
    # (docs/PERF.md, "The attention kernel on an H100"); register use from
    # benchmarks/investigations/kernel_report.py.
    ((9, 0), "16bit"): (
        (64, AttentionConfig(block_m=64, block_n=128, num_warps=4, num_stages=3)),
        (128, AttentionConfig(block_m=64, block_n=64, num_warps=4, num_stages=3)),
        # Spills ~0.8 KB of registers, yet timed 1.6x faster than the spill-free 64x64x8x2.
        (256, AttentionConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)),
    ),
    ((9, 0), "fp32"): (
        (64, AttentionConfig(block_m=64, block_n=32, num_warps=8, num_stages=2)),
        (128, AttentionConfig(block_m=64, block_n=32, num_warps=8, num_stages=2)),
        (256, AttentionConfig(block_m=32, block_n=32, num_warps=4, num_stages=2)),
    ),
    # Ampere/Ada and unknown GPUs: small tiles that fit 100 KB of shared memory (sm_86/89) and
    # compile for sm_80 without spills (not timed: no such GPU was available).
    ("default", "16bit"): (
        (64, AttentionConfig(block_m=64, block_n=64, num_warps=4, num_stages=2)),
        (128, AttentionConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)),
        (256, AttentionConfig(block_m=32, block_n=32, num_warps=4, num_stages=2)),
    ),
    ("default", "fp32"): (
        (64, AttentionConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)),
        (128, AttentionConfig(block_m=32, block_n=32, num_warps=4, num_stages=2)),
        (256, AttentionConfig(block_m=32, block_n=32, num_warps=4, num_stages=1)),
    ),
    # The CPU interpreter (TRITON_INTERPRET=1, tests): small tiles so that short test sequences
    # span several blocks and every block-skipping branch runs.
    ("interpreter", "16bit"): ((256, AttentionConfig(block_m=16, block_n=16, num_warps=1, num_stages=1)),),
    ("interpreter", "fp32"): ((256, AttentionConfig(block_m=16, block_n=16, num_warps=1, num_stages=1)),),
}

_JAGGED_TABLE: dict[object, JaggedConfig] = {
    "interpreter": JaggedConfig(block_rows=8, block_d=16, num_warps=1),
    "gpu": JaggedConfig(block_rows=32, block_d=128, num_warps=4),
}

_chosen_lock = threading.Lock()
_chosen: dict[str, dict[str, object]] = {}


def _capability_key(capability: tuple[int, int] | None) -> object:
    if capability is None:
        return "interpreter"
    # Ampere/Ada and anything unknown use the portable rows; Hopper (and later archs until they get
    # rows of their own) the sm_90 rows, which need only features sm_90 also has.
    return (9, 0) if tuple(capability) >= (9, 0) else "default"


def _dtype_class(dtype: torch.dtype) -> str:
    return "fp32" if dtype == torch.float32 else "16bit"


def attention_config(
    capability: tuple[int, int] | None, dqk: int, dv: int, dtype: torch.dtype
) -> AttentionConfig:
    """The attention config for a GPU of ``capability`` (None: the CPU interpreter)."""
    name, entry, config = _attention_config(None if capability is None else tuple(capability), dqk, dv, dtype)
    _record(name, entry)
    return config


@functools.cache
def _attention_config(
    capability: tuple[int, int] | None, dqk: int, dv: int, dtype: torch.dtype
) -> tuple[str, dict[str, object], AttentionConfig]:
    # Cached: the lookup runs on every launch (the recording, done by the caller, is cheap).
    if not (1 <= dqk <= 256 and 1 <= dv <= 256):
        raise ValueError(f"HSTU Triton attention supports head dims 1..256, got Dqk={dqk}, Dv={dv}")
    key = (_capability_key(capability), _dtype_class(dtype))
    d_pad = max(next_power_of_2(dqk), next_power_of_2(dv), 16)
    config = next(cfg for bound, cfg in _ATTENTION_TABLE[key] if d_pad <= bound)
    entry = {"kernel": "hstu_attn_fwd", "capability": _key_str(key[0]), "dtype": str(dtype), **dataclasses.asdict(config)}
    return f"attention/{_key_str(key[0])}/{key[1]}/dqk{dqk}_dv{dv}", entry, config


def jagged_config(capability: tuple[int, int] | None) -> JaggedConfig:
    """The config of the jagged copy kernels (None: the CPU interpreter)."""
    key = "interpreter" if capability is None else "gpu"
    config = _JAGGED_TABLE[key]
    _record(f"jagged/{key}", {"kernel": "jagged_copy", "capability": key, **dataclasses.asdict(config)})
    return config


def gate_config(capability: tuple[int, int] | None, width: int, block_rows: int | None = None,
                kernel: str = "stu_gate") -> JaggedConfig:
    """The config of the STU gate kernel over rows of ``width`` = H*Dv features (None: the CPU
    interpreter). A row is normalised whole, so block_d covers it; about 4K elements per program, or
    ``block_rows`` rows (``kernel`` names the kernel in the record)."""
    block_d = max(next_power_of_2(width), 16)
    if capability is None:
        key, config = "interpreter", JaggedConfig(block_rows=4, block_d=block_d, num_warps=1)
    else:
        key = "gpu"
        config = JaggedConfig(
            block_rows=max(1, min(16, 4096 // block_d)), block_d=block_d, num_warps=4 if block_d <= 1024 else 8
        )
    if block_rows is not None:
        config = dataclasses.replace(config, block_rows=block_rows)
    prefix = "gate" if kernel == "stu_gate" else kernel
    _record(f"{prefix}/{key}/width{width}", {"kernel": kernel, "capability": key, **dataclasses.asdict(config)})
    return config


def _key_str(key: object) -> str:
    return f"sm_{key[0]}{key[1]}" if isinstance(key, tuple) else str(key)


def _record(name: str, entry: dict[str, object]) -> None:
    with _chosen_lock:
        _chosen[name] = entry
        for collector in _collectors:
            collector[name] = entry


_collectors: list[dict[str, dict[str, object]]] = []


def chosen_configs() -> dict[str, dict[str, object]]:
    """Every kernel config selected in this process so far (JSON-ready)."""
    with _chosen_lock:
        return {name: dict(entry) for name, entry in sorted(_chosen.items())}


@contextlib.contextmanager
def collecting_configs() -> Iterator[dict[str, dict[str, object]]]:
    """Yields a dict that fills with the configs looked up (by any thread) while the block runs."""
    collected: dict[str, dict[str, object]] = {}
    with _chosen_lock:
        _collectors.append(collected)
    try:
        yield collected
    finally:
        with _chosen_lock:
            _collectors.remove(collected)
