"""Embedding tables stored quantized: torchrec's float EmbeddingCollection / EmbeddingBagCollection
swapped for torchrec's quantized inference modules (fbgemm's IntNBit table-batched embeddings).

Storage per row, as fbgemm's quantized TBE lays it out: ``int8``/``int4`` hold the row's codes plus a
row-wise fp16 scale and bias (4 bytes), ``fp16``/``none`` (fp32) the values; each row is padded to a
multiple of 16 bytes. Lookups return the export dtype (fp32 by default), so the dense half is unchanged.

The quantized modules are traced with torchrec's tracer and scripted at once: torchrec's quantized
modules script only that way (their lookup keeps a dict keyed by tuples, which TorchScript cannot
type), which is also how torchrec's own inference path scripts them. Held scripted in the sparse graph,
they run eagerly for verification, are kept as they are when a backend scripts the sparse half, and are
no graph for later passes to rewrite.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from hstu_export.errors import ConfigError, ExportError
from hstu_export.settings import EmbeddingQuantization

# Bits per stored value, and the per-row scale+bias bytes that integer modes add.
MODE_BITS = {"none": 32, "fp16": 16, "int8": 8, "int4": 4}
SCALE_BIAS_BYTES = {"int8": 4, "int4": 4}
ROW_ALIGNMENT = 16  # bytes; torchrec's default for its quantized modules
# The weight dtype torchrec's QuantConfig takes per table, by mode.
_WEIGHT_DTYPES = {"none": torch.float32, "fp16": torch.float16, "int8": torch.qint8, "int4": torch.quint4x2}


@dataclass(frozen=True)
class TableQuantization:
    """One table: where it lives, its shape, how it is stored and what that costs."""

    name: str
    module: str  # submodule path of its collection
    num_embeddings: int
    embedding_dim: int
    mode: str
    fp32_bytes: int
    bytes: int  # as stored in the package

    @property
    def saved_bytes(self) -> int:
        return self.fp32_bytes - self.bytes

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def stored_row_bytes(embedding_dim: int, mode: str) -> int:
    """Bytes one row takes in fbgemm's quantized TBE layout."""
    raw = math.ceil(embedding_dim * MODE_BITS[mode] / 8) + SCALE_BIAS_BYTES.get(mode, 0)
    return -(-raw // ROW_ALIGNMENT) * ROW_ALIGNMENT


def _float_collection_types() -> tuple[type, ...]:
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

    return EmbeddingCollection, EmbeddingBagCollection


def _configs(module: nn.Module) -> list[Any]:
    from torchrec.modules.embedding_modules import EmbeddingCollection

    return list(module.embedding_configs() if isinstance(module, EmbeddingCollection)  # type: ignore[operator]
                else module.embedding_bag_configs())  # type: ignore[operator]


def find_collections(model: nn.Module) -> dict[str, nn.Module]:
    """Submodule path -> float torchrec EmbeddingCollection / EmbeddingBagCollection (exact classes:
    subclasses such as managed-collision collections keep state the swap would lose)."""
    kinds = _float_collection_types()
    return {path: m for path, m in model.named_modules() if type(m) in kinds}


def plan_tables(collections: dict[str, nn.Module], quantization: EmbeddingQuantization) -> list[TableQuantization]:
    """Every table of ``collections`` with its mode; ConfigError for an override naming no table, or for
    asking quantization of a model that has no table this can quantize."""
    tables = []
    for path, module in collections.items():
        for cfg in _configs(module):
            mode = quantization.mode_of(cfg.name)
            rows, dim = int(cfg.num_embeddings), int(cfg.embedding_dim)
            tables.append(TableQuantization(cfg.name, path, rows, dim, mode, rows * dim * 4,
                                            rows * stored_row_bytes(dim, mode)))
    if quantization.requested and not tables:
        raise ConfigError("--quantize-embeddings: the model has no torchrec EmbeddingCollection or "
                          "EmbeddingBagCollection tables to quantize; leave the option out")
    unknown = sorted(set(quantization.tables) - {t.name for t in tables})
    if unknown:
        known = ", ".join(sorted({t.name for t in tables})) or "none"
        raise ConfigError(f"--quantize-table names {', '.join(unknown)}, which the model has no table of "
                          f"(its tables: {known})")
    return tables


def check_model(model: nn.Module, quantization: EmbeddingQuantization) -> list[TableQuantization]:
    """The plan for ``model``'s tables, refusing collections of other embedding classes when asked to
    quantize (before any tracing)."""
    from hstu_export.capture import EMBEDDING_MODULES, module_matches

    collections = find_collections(model)
    if quantization.requested:
        # Managed-collision or feature-processed collections, or a subclass of a collection: the swap would
        # drop what they add, and one holding a plain collection inside is called as a whole.
        others = [f"{p} ({type(m).__name__})" for p, m in model.named_modules()
                  if p and module_matches(m, p, EMBEDDING_MODULES) and p not in collections]
        if others:
            raise ConfigError(f"--quantize-embeddings supports torchrec EmbeddingCollection and "
                              f"EmbeddingBagCollection; {', '.join(others)} cannot be quantized: leave the option out")
    return plan_tables(collections, quantization)


def quantize_collection(module: nn.Module, modes: dict[str, str]) -> tuple[torch.jit.ScriptModule, dict[str, int]]:
    """torchrec's quantized counterpart of the float collection ``module`` with each table stored in
    ``modes[table]``, traced and scripted, and the bytes each table's rows take in it. Lookups return
    ``module``'s dtype."""
    import copy

    from torch.ao.quantization import PlaceholderObserver
    from torchrec.fx import symbolic_trace
    from torchrec.modules.embedding_configs import QuantConfig
    from torchrec.modules.embedding_modules import EmbeddingCollection
    from torchrec.quant.embedding_modules import EmbeddingBagCollection as QuantEmbeddingBagCollection
    from torchrec.quant.embedding_modules import EmbeddingCollection as QuantEmbeddingCollection

    weight = next(iter(module.parameters()))
    output_dtype = weight.dtype
    # fbgemm quantizes from fp32 or fp16 rows only: a bf16 model's tables are widened first.
    source = module if weight.dtype in (torch.float32, torch.float16) else copy.deepcopy(module).float()
    source.qconfig = QuantConfig(  # type: ignore[assignment]
        activation=PlaceholderObserver.with_args(dtype=output_dtype),
        weight=PlaceholderObserver.with_args(dtype=torch.float32),
        per_table_weight_dtype={name: _WEIGHT_DTYPES[mode] for name, mode in modes.items()},
    )
    try:
        quant_cls = QuantEmbeddingCollection if isinstance(module, EmbeddingCollection) else QuantEmbeddingBagCollection
        with torch.no_grad():
            quantized = quant_cls.from_float(source)  # type: ignore[arg-type]
    finally:
        del source.qconfig
    try:
        with warnings.catch_warnings():  # torchrec's code style, nothing the user can act on
            warnings.simplefilter("ignore", UserWarning)
            scripted = torch.jit.script(symbolic_trace(quantized))
    except Exception as exc:
        lines = str(exc).strip().splitlines()
        raise ExportError(f"TorchScript cannot compile torchrec's quantized {type(module).__name__}: "
                          f"{lines[0] if lines else type(exc).__name__}") from exc
    return scripted, table_bytes(quantized)


def table_bytes(collection: nn.Module) -> dict[str, int]:
    """Table name -> bytes of its rows in a torchrec collection, float or quantized (a quantized one's
    per-table weights are views of the rows the lookup reads)."""
    sizes: dict[str, int] = {}
    for name, tensor in collection.state_dict().items():
        parts = name.split(".")
        if len(parts) >= 3 and parts[0] in ("embeddings", "embedding_bags") and parts[-1].startswith("weight"):
            packed = getattr(tensor, "elem", tensor)  # torchrec wraps int4 rows in a 4-bit view of the bytes
            sizes[parts[1]] = sizes.get(parts[1], 0) + packed.numel() * packed.element_size()
    return sizes
