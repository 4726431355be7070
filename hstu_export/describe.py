"""A plain-data summary of a model bundle (what ``hstu-export describe`` prints)."""

from __future__ import annotations

from typing import Any

from torch import nn

from hstu_export.bundle import ModelBundle


def sparse_tables(model: nn.Module) -> list[dict[str, Any]]:
    """Every torchrec embedding table in the model: name, rows, dim, bytes, features."""
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

    tables = []
    for module in model.modules():
        if isinstance(module, (EmbeddingCollection, EmbeddingBagCollection)):
            configs = (module.embedding_configs() if isinstance(module, EmbeddingCollection)
                       else module.embedding_bag_configs())
            for cfg in configs:
                weight = module.embeddings[cfg.name].weight  # type: ignore[index]
                tables.append({
                    "name": cfg.name,
                    "num_embeddings": cfg.num_embeddings,
                    "embedding_dim": cfg.embedding_dim,
                    "bytes": weight.numel() * weight.element_size(),
                    "feature_names": list(cfg.feature_names),
                })
    return tables


def describe_bundle(bundle: ModelBundle) -> dict[str, Any]:
    params = list(bundle.model.parameters()) + list(bundle.model.buffers())
    config = bundle.config_dict or {}
    return {
        "model_name": bundle.model_name,
        "config": config,
        "num_parameters": sum(p.numel() for p in params),
        "parameter_bytes": sum(p.numel() * p.element_size() for p in params),
        "sparse_tables": sparse_tables(bundle.model),
        "example_batch": {k: (tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in bundle.example_batch.items()},
    }
