"""A plain-data summary of a model bundle (what ``hstu-export describe`` prints)."""

from __future__ import annotations

from typing import Any

from torch import nn

from hstu_export.package.schema import ONE_PER_USER
from hstu_export.settings import EmbeddingQuantization
from hstu_export.sources.bundle import ModelBundle


def sparse_tables(model: nn.Module) -> list[dict[str, Any]]:
    """Every torchrec embedding table in the model (EmbeddingCollection, EmbeddingBagCollection, their
    quantized counterparts, anything else that lists its tables so): name, rows, dim, how its rows are
    stored, bytes, features."""
    from hstu_export.embedding_quantization import table_bytes

    tables = []
    counted: list[str] = []
    for path, module in model.named_modules():
        configs = _table_configs(module)
        if configs is None or any(path.startswith(f"{c}.") for c in counted):
            continue  # a collection inside one already counted (a managed-collision wrapper's) is the same
        counted.append(path)
        sizes = table_bytes(module)
        for cfg in configs:
            data_type = getattr(cfg, "data_type", None)
            tables.append({
                "name": cfg.name,
                "num_embeddings": cfg.num_embeddings,
                "embedding_dim": cfg.embedding_dim,
                "data_type": str(getattr(data_type, "value", data_type or "")).lower(),
                "bytes": sizes.get(cfg.name, 0),
                "feature_names": list(cfg.feature_names),
            })
    return tables


def _table_configs(module: nn.Module) -> list[Any] | None:
    """The table configs a torchrec collection lists (``embedding_configs()`` or ``embedding_bag_configs()``)."""
    for method in ("embedding_configs", "embedding_bag_configs"):
        listed = getattr(type(module), method, None)
        if callable(listed):
            configs = listed(module)
            return list(configs) if isinstance(configs, (list, tuple)) else None
    return None


def describe_bundle(bundle: ModelBundle, quantization: EmbeddingQuantization | None = None) -> dict[str, Any]:
    """With ``quantization`` asked for, each sparse table gains ``quantization``: its mode and the bytes
    it would take stored so (fbgemm's row layout, ``hstu_export.embedding_quantization``)."""
    from hstu_export.embedding_quantization import check_model

    tables = sparse_tables(bundle.model)
    if quantization is not None and quantization.requested:
        planned = {(t.name, t.num_embeddings, t.embedding_dim): t for t in check_model(bundle.model, quantization)}
        for table in tables:
            plan = planned.get((table["name"], table["num_embeddings"], table["embedding_dim"]))
            if plan is not None:
                table["quantization"] = {"mode": plan.mode, "bytes": plan.bytes}
    params = list(bundle.model.parameters()) + list(bundle.model.buffers())
    config = bundle.config_dict or {}
    schema = bundle.input_schema
    source = bundle.source or {}
    return {
        "model_name": bundle.model_name,
        "source": {"factory": f"factory {source.get('factory')}", "registered": "registered model",
                   "pickled": "pickled module"}.get(source.get("kind", ""), ""),
        "arguments": [_argument_text(a) for a in schema.arguments],
        "features": [{"name": f.name, "kind": _kind_text(f), "dtype": f.dtype,
                      "range": _range_text(f, stated=bundle.schema is not None)} for f in schema.features],
        "config": config,
        "num_parameters": sum(p.numel() for p in params),
        "parameter_bytes": sum(p.numel() * p.element_size() for p in params),
        "sparse_tables": tables,
        "example_batch": {k: (tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in bundle.example_batch.items()},
    }


def _argument_text(arg: Any) -> str:
    if arg.optional_absent:
        return f"{arg.name}=None"
    if arg.kind == "kjt":
        return f"{arg.name}: KeyedJaggedTensor[{', '.join(arg.keys)}]"
    return f"{arg.name}: {arg.type_text()}"


def _kind_text(f: Any) -> str:
    if f.kind == "jagged":
        return f"jagged by {f.jagged_by}"
    if f.kind == "lengths" and f.same_as:
        return f"lengths (= {f.same_as})"
    return f.kind


def _range_text(f: Any, stated: bool) -> str:
    """``lo..hi``; a lengths range says whose it is: stated when the bundle was saved (a default --max-length
    may widen), the model's own limit (its input schema), or one value per user as the example had it (a
    contextual key, which a range stated on its argument does not widen)."""
    if f.min_value is None and f.max_value is None:
        return ""
    lo = "" if f.min_value is None else f.min_value
    hi = "not stated" if f.max_value is None and f.kind == "lengths" else ("" if f.max_value is None else f.max_value)
    if f.kind != "lengths" or f.max_value is None:
        whose = ""
    elif f.semantic == ONE_PER_USER and f.min_value == f.max_value == 1:
        whose = " (one per user)"  # inferred from the example; a range on its argument leaves it so
    else:
        whose = " (stated)" if stated else " (model limit)"
    return f"{lo}..{hi}{whose}"
