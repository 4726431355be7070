"""Export settings: one typed object. The CLI only builds it; the Python API takes it directly."""

from __future__ import annotations

import dataclasses
import numbers
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hstu_export.errors import ConfigError

DTYPE_ALIASES = {
    "fp32": "float32", "float32": "float32", "float": "float32",
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "fp16": "float16", "float16": "float16", "half": "float16",
}
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Parity tolerances by dtype: relative L2 error ‖out−ref‖/‖ref‖ and max absolute error, per output.
DEFAULT_TOLERANCES = {
    "float32": {"rel_l2": 1e-5, "max_abs": 1e-4},
    "bfloat16": {"rel_l2": 2e-2, "max_abs": 5e-2},
    "float16": {"rel_l2": 5e-3, "max_abs": 1e-2},
}
# fp32 through our Triton kernels on CUDA when torch's fp32 matmul precision allows TF32 ("high" or "medium"): their
# dot products then run in TF32 (10-bit mantissa inputs), as torch's own products do (ops/_triton/configs.py).
TF32_TOLERANCES = {"rel_l2": 2e-4, "max_abs": 5e-4}
# fp32 against a reference run on another device (--reference-device cpu for a CUDA export): the two devices sum in
# their own orders. On an H200 the TorchEasyRec-style model at DLRMv3's dims came 1.9e-5 rel. L2 (2.1e-6 max abs) from
# its CPU forward, generative-recommenders' DlrmHSTU 1.5e-5 (6.4e-5; its attention's products then in TF32); TF32
# products put the former 2.4e-3 away (docs/PERF.md, "CUDA correctness").
CROSS_DEVICE_TOLERANCES = {"rel_l2": 1e-4, "max_abs": 1e-4}
MAX_BATCH_SIZE = 65_536

_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50, "k": 2**10, "m": 2**20,
               "g": 2**30}


def parse_size(text: str | int) -> int:
    """``4GiB``, ``512MiB``, ``1.5GB`` or plain bytes -> bytes."""
    if isinstance(text, int):
        if text <= 0:
            raise ConfigError(f"size must be positive, got {text}")
        return text
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ConfigError(f"cannot read size {text!r}: use bytes or a unit such as 512MiB, 4GiB, 2GB")
    value = float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()]
    if value < 1:
        raise ConfigError(f"size must be at least one byte, got {text!r}")
    return int(value)


def check_whole_number(value: Any, what: str, least: int, unit: str = "") -> int:
    """``value`` as an int: a whole number (not a bool) of at least ``least``; refused in one line naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
        of = f" of {unit}" if unit else ""
        raise ConfigError(f"{what} must be a whole number{of}, {least} or more, got {value!r}")
    return int(value)


def check_time_drift(value: Any, what: str = "max_time_drift") -> int:
    """A KV cache's max time drift: whole seconds, 0 or more (0: a cached row's time buckets must be exact)."""
    return check_whole_number(value, what, 0, "seconds")


def format_bytes(n: float) -> str:
    """``1536`` -> ``1.5 KiB``: sizes in messages (estimates, free space, memory)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"


def machine_memory() -> tuple[int, int]:
    """(total, available) bytes of memory this process may use: ``/proc/meminfo`` (MemAvailable counts the
    page cache that can be dropped), else ``sysconf``; within a container's cgroup limit (v2 or v1), which
    /proc/meminfo does not show."""
    total, available = _host_memory()
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        limit, usage = _read_int(limit_file), _read_int(usage_file)
        if limit is not None and limit < total:
            total = limit
            available = min(available, max(limit - (usage or 0), 0))
            break
    return total, available


def _host_memory() -> tuple[int, int]:
    try:
        fields = {}
        with open("/proc/meminfo") as f:
            for line in f:
                name, _, value = line.partition(":")
                parts = value.split()
                if parts and parts[0].isdigit():
                    fields[name] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
        return fields["MemTotal"], fields.get("MemAvailable", fields.get("MemFree", fields["MemTotal"]))
    except (OSError, KeyError, ValueError):
        pass
    page = os.sysconf("SC_PAGE_SIZE")
    total = os.sysconf("SC_PHYS_PAGES") * page
    try:
        return total, os.sysconf("SC_AVPHYS_PAGES") * page
    except (ValueError, OSError):
        return total, total


def _read_int(path: str) -> int | None:
    """The number in a one-line file (a cgroup limit), or None (absent, unreadable, or "max")."""
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def normalize_dtype(name: str) -> str:
    try:
        return DTYPE_ALIASES[str(name).lower()]
    except KeyError:
        raise ConfigError(f"unknown dtype {name!r}; use fp32, bf16 or fp16") from None


@dataclass
class VerifySettings:
    enabled: bool = True
    num_random_batches: int = 4
    seed: int = 1234
    tolerances: dict[str, float] | None = None  # None: DEFAULT_TOLERANCES for the dtype
    rtol: float | None = None  # overrides the relative L2 tolerance
    atol: float | None = None  # overrides the max absolute tolerance

    def __post_init__(self) -> None:
        for name in ("rtol", "atol"):
            value = getattr(self, name)
            if value is not None and not (value >= 0 and value == value and value != float("inf")):
                raise ConfigError(f"--{name} must be a finite number >= 0, got {value}")


def parse_attention_scale(text: str) -> str:
    """``batch`` (divide by the max length the model computes from the batch, as the model does) or
    ``fixed:N`` (divide by N, the same for every request)."""
    text = str(text).strip()
    if text == "batch":
        return text
    kind, _, value = text.partition(":")
    if kind == "fixed" and value.isdigit() and int(value) > 0:
        return f"fixed:{int(value)}"
    raise ConfigError(f"--attention-scale {text!r}: use 'batch' or 'fixed:N' with N a positive integer")


def parse_inductor_option(text: str) -> tuple[str, bool | int | float | str]:
    """``KEY=VALUE`` (``--aoti-option``) -> (KEY, VALUE): ``true``/``false`` a bool, a number an int or float,
    anything else the string. The key is checked by :func:`checked_inductor_options`."""
    key, sep, raw = str(text).partition("=")
    key, raw = key.strip(), raw.strip()
    if not sep or not key or not raw:
        raise ConfigError(f"--aoti-option {text!r}: use KEY=VALUE with an Inductor config key, e.g. combo_kernels=true")
    lowered = raw.lower()
    if lowered in ("true", "false"):
        return key, lowered == "true"
    for kind in (int, float):
        try:
            return key, kind(raw)
        except ValueError:
            pass
    return key, raw


def checked_inductor_options(options: Any) -> dict[str, bool | int | float | str]:
    """Inductor config options for AOTInductor's compiles (``--aoti-option``), checked against the installed
    torch's config: a key it does not have, or a value of another type than the key's, is refused in one line
    (Inductor would otherwise fail deep inside the compile, or ignore it)."""
    if not isinstance(options, dict):
        raise ConfigError(f"aoti_options must be a dict of Inductor config keys to values, got {options!r}")
    import torch._inductor.config as inductor_config

    known = inductor_config.get_config_copy()
    checked: dict[str, bool | int | float | str] = {}
    for key, value in options.items():
        if not isinstance(key, str) or key not in known:
            raise ConfigError(f"--aoti-option {key!r}: torch {torch.__version__} has no Inductor config of that name "
                              "(see torch._inductor.config)")
        default = known[key]
        if not isinstance(value, bool | int | float | str):
            raise ConfigError(f"--aoti-option {key}: expected a bool, number or string, got {value!r}")
        if isinstance(default, bool) and not isinstance(value, bool):
            raise ConfigError(f"--aoti-option {key}={value!r}: expected true or false")
        if isinstance(default, int | float) and not isinstance(default, bool) and (
                isinstance(value, bool) or not isinstance(value, int | float)):
            raise ConfigError(f"--aoti-option {key}={value!r}: expected a number")
        checked[key] = value
    return checked


def parse_length_range(text: str) -> tuple[str, tuple[int | None, int]]:
    """``NAME=MAX`` or ``NAME=MIN:MAX`` (``--max-length``) -> (NAME, (MIN or None, MAX))."""
    name, sep, value = str(text).partition("=")
    lo_text, colon, hi_text = value.partition(":")
    if not colon:
        lo_text, hi_text = "", lo_text
    try:
        lo = int(lo_text) if lo_text.strip() else None
        hi = int(hi_text)
    except ValueError:
        lo = hi = None  # type: ignore[assignment]
    if not sep or not name.strip() or hi is None or hi < 1 or (lo is not None and not 0 <= lo <= hi):
        raise ConfigError(f"--max-length {text!r}: use NAME=MAX or NAME=MIN:MAX with 0 <= MIN <= MAX, MAX >= 1")
    return name.strip(), (lo, hi)


def parse_output_names(items: str | tuple[str, ...] | list[str] | dict[str, str] | None) -> dict[str, str]:
    """``output_0=user_embeddings,output_1=item_embeddings`` (one string or several; or a dict) -> {the
    model's output: the package's name} (``--output-names``). The names are checked against the model, and
    for what the runtimes can carry, at export (``hstu_export.sources.output_plan``)."""
    if items is None:
        return {}
    if isinstance(items, dict):
        pairs = list(items.items())
    else:
        pairs = []
        for text in [items] if isinstance(items, str) else list(items):
            for part in str(text).split(","):
                if not part.strip():
                    continue
                old, sep, new = part.partition("=")
                if not sep or not old.strip():
                    raise ConfigError(f"--output-names {part.strip()!r}: use MODEL_OUTPUT=NAME "
                                      "(e.g. output_0=user_embeddings,output_1=item_embeddings)")
                pairs.append((old.strip(), new.strip()))
    renames: dict[str, str] = {}
    for old, new in pairs:
        if not isinstance(old, str) or not isinstance(new, str):
            raise ConfigError(f"--output-names {old!r}={new!r}: names are strings")
        if old in renames and renames[old] != new:
            raise ConfigError(f"--output-names {old}: renamed twice ({renames[old]!r} and {new!r})")
        renames[old] = new
    return renames


def parse_score_outputs(items: str | tuple[str, ...] | list[str] | None) -> tuple[str, ...]:
    """``ctr,cvr`` (one string or several) -> ("ctr", "cvr") (``--score-outputs``)."""
    if items is None:
        return ()
    texts = [items] if isinstance(items, str) else list(items)
    return tuple(dict.fromkeys(part.strip() for text in texts for part in str(text).split(",") if part.strip()))


# Embedding-table quantization (--quantize-embeddings): the storage modes of torchrec's quantized
# inference modules, coarsest last. "none" keeps a table in fp32.
QUANTIZATION_MODES = ("none", "fp16", "int8", "int4")
# Verification of a quantized package against the fp32 model: the error is the quantization's, not the
# compiler's, so the tolerances follow the coarsest mode among the tables (docs/QUANTIZATION.md).
QUANTIZED_TOLERANCES = {
    "fp16": {"rel_l2": 5e-3, "max_abs": 2e-3},
    "int8": {"rel_l2": 2e-2, "max_abs": 1e-2},
    "int4": {"rel_l2": 1e-1, "max_abs": 5e-2},
}
# The outputs of a quantized package that are not scores (embeddings...) are held to relative L2 error only:
# a few times the rounding error quantization itself leaves in a table row (docs/QUANTIZATION.md, "Outputs
# other than scores").
QUANTIZED_RELATIVE_L2 = {"fp16": 2e-3, "int8": 3e-2, "int4": 5e-1}


def parse_quantization_mode(text: str, what: str = "--quantize-embeddings") -> str:
    mode = str(text).strip().lower()
    if mode not in QUANTIZATION_MODES:
        raise ConfigError(f"{what} {text!r}: unknown mode; use one of {', '.join(QUANTIZATION_MODES)}")
    return mode


def parse_table_modes(items: str | tuple[str, ...] | list[str]) -> dict[str, str]:
    """``item=int4,action=none`` (one string or several) -> {table: mode} (``--quantize-table``)."""
    texts = [items] if isinstance(items, str) else list(items)
    modes: dict[str, str] = {}
    for text in texts:
        for part in str(text).split(","):
            if not part.strip():
                continue
            name, sep, mode = part.partition("=")
            if not sep or not name.strip():
                raise ConfigError(f"--quantize-table {part.strip()!r}: use TABLE=MODE (e.g. item=int4,action=none)")
            modes[name.strip()] = parse_quantization_mode(mode, f"--quantize-table {name.strip()}=")
    return modes


@dataclass
class EmbeddingQuantization:
    """How the sparse half's embedding tables are stored: ``mode`` for every table, ``tables`` overriding
    it by table name. ``tolerances`` replaces ``QUANTIZED_TOLERANCES`` (by mode) for verification."""

    mode: str = "none"
    tables: dict[str, str] = field(default_factory=dict)
    tolerances: dict[str, dict[str, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.mode = parse_quantization_mode(self.mode)
        self.tables = {str(k): parse_quantization_mode(v, f"--quantize-table {k}=") for k, v in self.tables.items()}
        for mode, tol in self.tolerances.items():
            parse_quantization_mode(mode, "quantization tolerance for")
            if not isinstance(tol, dict) or set(tol) - {"rel_l2", "max_abs"} or not all(
                    isinstance(v, int | float) and v >= 0 for v in tol.values()):
                raise ConfigError(f"quantization tolerance for {mode}: expected {{'rel_l2': x, 'max_abs': y}} "
                                  f"with numbers >= 0, got {tol!r}")

    @property
    def requested(self) -> bool:
        """Whether any table is to be stored other than in fp32."""
        return self.mode != "none" or any(m != "none" for m in self.tables.values())

    def mode_of(self, table: str) -> str:
        return self.tables.get(table, self.mode)

    def tolerances_for(self, modes: list[str]) -> dict[str, float] | None:
        """Verification tolerances of a package whose tables use ``modes``: the coarsest mode's (None when
        every table stays fp32)."""
        used = [m for m in modes if m != "none"]
        if not used:
            return None
        coarsest = max(used, key=QUANTIZATION_MODES.index)
        return {**QUANTIZED_TOLERANCES[coarsest], **self.tolerances.get(coarsest, {})}


@dataclass
class ExportSettings:
    backend: str = "aoti"
    device: str = "cpu"
    dtype: str = "float32"
    max_batch_size: int = 32
    max_seq_len: int | None = None  # max history length per user; None: the model's own bound
    max_candidates: int | None = None  # max candidates per user; None: the model's own bound
    op_target: str | None = None  # triton | aten | fbgemm; None: the backend's default for the device
    allow_unmapped: bool = False
    workspace_bytes: int | None = None  # TensorRT
    min_block_size: int = 5  # TensorRT
    torch_executed_ops: tuple[str, ...] = ()  # TensorRT
    dryrun: bool = False  # TensorRT: report what would run where, build nothing
    passes: tuple[str, ...] | None = None
    skip_passes: tuple[str, ...] = ()
    leaf_modules: tuple[str, ...] = ()
    opaque_functions: tuple[str, ...] = ()  # functions to record as single calls while tracing
    lengths: dict[str, tuple[int | None, int | None]] = field(default_factory=dict)  # --max-length
    attention_scale: str = "batch"  # "batch" or "fixed:N" for mapped foreign attention
    op_mappings: dict[str, str] = field(default_factory=dict)  # --map-function NAME=RULE
    imports: tuple[str, ...] = ()  # modules imported before the bundle is read (--import)
    check_each_pass: bool = False
    dump_dir: Path | None = None
    graphs_in_package: bool = False  # copy the graph dumps into the package (graphs/)
    verify: VerifySettings = field(default_factory=VerifySettings)
    quantization: EmbeddingQuantization = field(default_factory=EmbeddingQuantization)
    # The package's names for the model's outputs (--output-names output_0=user_embeddings,...), and the
    # outputs that are per-candidate scores (--score-outputs): hstu_export.sources.output_plan.
    output_names: dict[str, str] = field(default_factory=dict)
    score_outputs: tuple[str, ...] = ()
    force: bool = False
    kv_cache: bool = False  # also export the delta program for KV-cached serving (hstu_export.kv_export)
    kv_page_size: int = 64  # tokens per cache page the delta program reads (a power of two >= 16)
    kv_splits: int = 0  # key slices of the Triton paged attention in the delta program; 0: chosen per call
    # Which delta program (--kv-program): "written" (models/cached.py, for the zoo's HstuRankingModel only),
    # "derived" (hstu_export.kv_derive, from the traced dense half: any model), "auto" (written for the zoo).
    kv_program: str = "auto"
    # Inductor config options for the AOTInductor compiles (--aoti-option KEY=VALUE): the dense program's and
    # the delta program's (which has defaults of its own on CUDA: kv_export.DELTA_INDUCTOR_OPTIONS)
    aoti_options: dict[str, Any] = field(default_factory=dict)
    # The aoti backend's compiled sparse half also as a second model whose ids are clamped instead of checked, which
    # the runtimes run after checking the manifest's ranges on the host (--prechecked-sparse): "auto" (for CUDA, where
    # the checked one makes the host wait for the device), "on", "off".
    prechecked_sparse: str = "auto"
    # Where the user's model runs as verification's reference, in fp32, and while the graph is traced and
    # observed (--reference-device): for models whose own ops do not run on the export device (fbgemm's
    # jagged ops on a GPU machine with fbgemm's CPU build). None: on the export device, in the export dtype.
    reference_device: str | None = None

    def __post_init__(self) -> None:
        self.dtype = normalize_dtype(self.dtype)
        if self.device not in ("cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise ConfigError(f"unknown device {self.device!r}; use cpu or cuda")
        # Integers from the Python API too: 1e9 (a float) or "32" would otherwise fail deep inside the export.
        for name in ("max_batch_size", "max_seq_len", "max_candidates", "min_block_size"):
            value = getattr(self, name)
            if value is None and name in ("max_seq_len", "max_candidates"):
                continue
            if not isinstance(value, int) or isinstance(value, bool):
                raise ConfigError(f"--{name.replace('_', '-')} must be a whole number, got {value!r}")
            if value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        for feature, bounds in self.lengths.items():
            if not (isinstance(bounds, tuple | list) and len(bounds) == 2 and all(
                    v is None or (isinstance(v, int) and not isinstance(v, bool)) for v in bounds)):
                raise ConfigError(f"--max-length {feature}: expected (MIN or None, MAX) in whole numbers, got {bounds!r}")
        self.output_names = parse_output_names(self.output_names)
        self.score_outputs = parse_score_outputs(self.score_outputs)
        if self.op_target is not None:
            self.op_target = {"rtp": "aten"}.get(self.op_target, self.op_target)
            if self.op_target not in ("triton", "aten", "fbgemm"):
                raise ConfigError(f"unknown op target {self.op_target!r}; use triton, aten (alias rtp) or fbgemm")
        if self.dump_dir is not None:
            self.dump_dir = Path(self.dump_dir)
        if self.reference_device is not None and self.reference_device != "cpu":
            raise ConfigError(f"--reference-device {self.reference_device!r}: only cpu is supported (the reference "
                              "runs on the export device otherwise)")
        self.attention_scale = parse_attention_scale(self.attention_scale)
        if not (isinstance(self.kv_page_size, int) and self.kv_page_size >= 16
                and not self.kv_page_size & (self.kv_page_size - 1)):
            raise ConfigError(f"--kv-page-size must be a power of two >= 16, got {self.kv_page_size!r}")
        if not (isinstance(self.kv_splits, int) and 0 <= self.kv_splits <= 64):
            raise ConfigError(f"--kv-splits must be a whole number from 0 (chosen per call) to 64, got {self.kv_splits!r}")
        if self.kv_program not in ("auto", "written", "derived"):
            raise ConfigError(f"--kv-program must be auto, written or derived, got {str(self.kv_program)[:40]!r}")
        if self.kv_program != "auto" and not self.kv_cache:
            raise ConfigError(f"--kv-program {self.kv_program} chooses the delta program of --kv-cache; add --kv-cache")
        self.aoti_options = checked_inductor_options(self.aoti_options)
        if self.aoti_options and self.backend != "aoti":
            raise ConfigError(f"--aoti-option configures AOTInductor's compile; it needs --backend aoti (not {self.backend})")
        if self.prechecked_sparse not in ("auto", "on", "off"):
            raise ConfigError(f"--prechecked-sparse must be auto, on or off, got {self.prechecked_sparse!r}")
        if self.prechecked_sparse == "on" and self.backend != "aoti":
            raise ConfigError(f"--prechecked-sparse on adds a model to the sparse half AOTInductor compiles; it needs "
                              f"--backend aoti (not {self.backend})")
        if isinstance(self.quantization, str):  # Python API shorthand: quantization="int8"
            self.quantization = EmbeddingQuantization(self.quantization)
        elif not isinstance(self.quantization, EmbeddingQuantization):
            raise ConfigError(f"quantization must be an EmbeddingQuantization or a mode name, got {self.quantization!r}")
        if self.max_batch_size > MAX_BATCH_SIZE:
            raise ConfigError(f"--max-batch-size {self.max_batch_size} is beyond {MAX_BATCH_SIZE:,}; "
                              "serving batches are split long before that")

    @property
    def prechecked_for_device(self) -> bool:
        """Whether the compiled sparse half gets its prechecked model (``prechecked_sparse``; auto: on CUDA)."""
        return self.prechecked_sparse == "on" or (self.prechecked_sparse == "auto" and self.device != "cpu")

    @property
    def torch_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.dtype]

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def reference_torch_device(self) -> torch.device:
        """Where the user's model runs (reference, tracing): ``--reference-device`` or the export device."""
        return torch.device(self.reference_device) if self.reference_device else self.torch_device

    @property
    def reference_torch_dtype(self) -> torch.dtype:
        """fp32 with ``--reference-device``; the export dtype otherwise (the model converted as exported)."""
        return torch.float32 if self.reference_device else self.torch_dtype

    def tolerances(self, quantized_modes: list[str] | None = None) -> dict[str, float]:
        """Verification tolerances; ``quantized_modes`` (the tables' storage modes) widen them to the
        coarsest mode's where the dtype's are tighter, as the package is compared with the fp32 model."""
        quantized = self.quantization.tolerances_for(quantized_modes or [])
        if self.verify.tolerances:
            base = dict(self.verify.tolerances)
        elif self.dtype == "float32" and self.torch_device.type == "cuda" and \
                torch.get_float32_matmul_precision() != "highest":
            base = dict(TF32_TOLERANCES)  # fp32 products in TF32: ours on the triton target, cuBLAS's on any
        elif self.dtype == "float32" and self.reference_torch_device.type != self.torch_device.type:
            base = dict(CROSS_DEVICE_TOLERANCES)
        else:
            base = dict(DEFAULT_TOLERANCES[self.dtype])
        if quantized is not None and not self.verify.tolerances:
            base = {key: max(value, quantized[key]) for key, value in base.items()}
        if self.verify.rtol is not None:
            base["rel_l2"] = self.verify.rtol
        if self.verify.atol is not None:
            base["max_abs"] = self.verify.atol
        return base

    def relative_tolerances(self, quantized_modes: list[str]) -> dict[str, float]:
        """Verification tolerances of a quantized package's outputs that are not scores: relative L2 only
        (``QUANTIZED_RELATIVE_L2`` of the coarsest mode, or the dtype's where looser); ``--rtol``/``--atol``
        and ``VerifySettings.tolerances`` hold as given."""
        if self.verify.tolerances:
            return self.tolerances()
        used = [m for m in quantized_modes if m != "none"]
        base = self.tolerances()
        held = {"rel_l2": max([base["rel_l2"], *(QUANTIZED_RELATIVE_L2[m] for m in used)])}
        if self.verify.rtol is not None:
            held["rel_l2"] = self.verify.rtol
        if self.verify.atol is not None:
            held["max_abs"] = self.verify.atol
        return held

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["dump_dir"] = str(self.dump_dir) if self.dump_dir else None
        return data
