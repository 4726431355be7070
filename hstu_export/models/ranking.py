"""DLRM-HSTU style ranking model: torchrec sparse arch → HSTU transducer → multi-task heads.

The model's input is a flat dict of named tensors (the input schema below), so bundles store plain
tensors and the predictor can validate requests by name. Per user ``b``:
- history: ``uih_item_ids``, ``uih_action_ids``, ``uih_timestamps`` (jagged by ``uih_lengths``);
- candidates: ``candidate_item_ids`` (jagged by ``candidate_lengths``);
- ``query_time`` [B] and one id per contextual feature [B].
Output: ``{task: probability [num_candidates]}``.
"""

from __future__ import annotations

from typing import Dict  # noqa: UP035  (TorchScript reads these annotations)

import torch
from torch import Tensor, nn
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection

from hstu_export.capture.graph_functions import build_kjt, per_user_as_jagged, sparse_boundary
from hstu_export.models.config import HSTUConfig
from hstu_export.models.transducer import HSTUTransducer
from hstu_export.package.schema import FeatureSpec, InputSchema
from hstu_export.sources.hints import ExportHints

HISTORY_LENGTHS = "uih_lengths"
CANDIDATE_LENGTHS = "candidate_lengths"
HISTORY_TOKEN_FEATURES = ("uih_item_ids", "uih_action_ids", "uih_timestamps")  # one value per history token


def ranking_input_schema(config: HSTUConfig) -> InputSchema:
    features = [
        FeatureSpec(HISTORY_LENGTHS, "int64", "lengths", min_value=1, max_value=config.max_history_len,
                    semantic="history_length"),
        FeatureSpec(CANDIDATE_LENGTHS, "int64", "lengths", min_value=1, max_value=config.max_num_candidates,
                    semantic="candidate_count"),
        FeatureSpec("uih_item_ids", "int64", "jagged", jagged_by=HISTORY_LENGTHS, min_value=0,
                    max_value=config.item_vocab_size - 1),
        FeatureSpec("uih_action_ids", "int64", "jagged", jagged_by=HISTORY_LENGTHS, min_value=0,
                    max_value=config.action_vocab_size - 1),
        FeatureSpec("uih_timestamps", "int64", "jagged", jagged_by=HISTORY_LENGTHS, semantic="timestamp"),
        FeatureSpec("candidate_item_ids", "int64", "jagged", jagged_by=CANDIDATE_LENGTHS, min_value=0,
                    max_value=config.item_vocab_size - 1),
        FeatureSpec("query_time", "int64", "per_user", semantic="timestamp"),
    ]
    features += [
        FeatureSpec(name, "int64", "per_user", min_value=0, max_value=vocab - 1)
        for name, vocab in zip(config.contextual_features, config.contextual_vocab_sizes)
    ]
    return InputSchema(tuple(features))


class HstuSparseArch(nn.Module):
    """torchrec EmbeddingCollection: a shared item table (history and candidates), an action table,
    one table per contextual feature."""

    def __init__(self, config: HSTUConfig) -> None:
        super().__init__()
        d = config.embedding_dim
        self.contextual_features = list(config.contextual_features)
        tables = [
            EmbeddingConfig(name="item", embedding_dim=d, num_embeddings=config.item_vocab_size,
                            feature_names=["uih_item_ids", "candidate_item_ids"]),
            EmbeddingConfig(name="action", embedding_dim=d, num_embeddings=config.action_vocab_size,
                            feature_names=["uih_action_ids"]),
        ]
        tables += [
            EmbeddingConfig(name=f"ctx_{name}", embedding_dim=d, num_embeddings=vocab, feature_names=[name])
            for name, vocab in zip(config.contextual_features, config.contextual_vocab_sizes)
        ]
        self.embedding_collection = EmbeddingCollection(tables=tables, device=torch.device("cpu"))
        for table in self.embedding_collection.embeddings.values():
            nn.init.normal_(table.weight, std=0.05)

    def forward(self, features: Dict[str, Tensor]) -> Dict[str, Tensor]:  # noqa: UP006
        hist_len = features[HISTORY_LENGTHS]
        cand_len = features[CANDIDATE_LENGTHS]
        ctx_ids = [features[name] for name in self.contextual_features]
        kjt = build_kjt(
            ["uih_item_ids", "candidate_item_ids", "uih_action_ids", *self.contextual_features],
            [features["uih_item_ids"], features["candidate_item_ids"], features["uih_action_ids"], *ctx_ids],
            [hist_len, cand_len, hist_len, *[per_user_as_jagged(ids) for ids in ctx_ids]],
        )
        emb = self.embedding_collection(kjt)
        out = {
            "uih_item_emb": sparse_boundary(emb["uih_item_ids"].values(), "uih_item_emb", HISTORY_LENGTHS),
            "uih_action_emb": sparse_boundary(emb["uih_action_ids"].values(), "uih_action_emb", HISTORY_LENGTHS),
            "candidate_item_emb": sparse_boundary(
                emb["candidate_item_ids"].values(), "candidate_item_emb", CANDIDATE_LENGTHS
            ),
        }
        for name in self.contextual_features:
            out[f"{name}_emb"] = sparse_boundary(emb[name].values(), f"{name}_emb", "")
        return out


class MultiTaskHeads(nn.Module):
    def __init__(self, config: HSTUConfig) -> None:
        super().__init__()
        self.task_names = list(config.task_names)
        self.heads = nn.ModuleList()
        for _ in config.task_names:
            layers: list[nn.Module] = []
            width = config.embedding_dim
            for hidden in config.task_hidden_dims:
                layers += [nn.Linear(width, hidden), nn.SiLU()]
                width = hidden
            layers.append(nn.Linear(width, 1))
            self.heads.append(nn.Sequential(*layers))

    def forward(self, x: Tensor) -> Dict[str, Tensor]:  # noqa: UP006
        return {name: torch.sigmoid(head(x).squeeze(-1)) for name, head in zip(self.task_names, self.heads)}


class HstuRankingModel(nn.Module):
    """The zoo's ranking model; registered as ``hstu_ranking`` (``hstu_export.sources.registry.ZOO``)."""

    config_class = HSTUConfig

    def __init__(self, config: HSTUConfig) -> None:
        super().__init__()
        self.config = config
        self.sparse_arch = HstuSparseArch(config)
        self.transducer = HSTUTransducer(config)
        self.task_heads = MultiTaskHeads(config)

    def input_schema(self) -> InputSchema:
        return ranking_input_schema(self.config)

    def hstu_export_hints(self) -> ExportHints:
        # Every task head ends in a sigmoid: its output is a probability per candidate.
        return ExportHints(output_kinds={name: "probability" for name in self.config.task_names})

    def forward(self, features: Dict[str, Tensor]) -> Dict[str, Tensor]:  # noqa: UP006
        emb = self.sparse_arch(features)
        # Embeddings come out of torchrec in fp32; run the dense part in the model's own dtype.
        dtype = self.transducer.post_norm_weight.dtype
        candidates = self.transducer(
            emb["uih_item_emb"].to(dtype),
            emb["uih_action_emb"].to(dtype),
            emb["candidate_item_emb"].to(dtype),
            [emb[f"{name}_emb"].to(dtype) for name in self.config.contextual_features],
            features[HISTORY_LENGTHS],
            features[CANDIDATE_LENGTHS],
            features["uih_timestamps"],
            features["query_time"],
        )
        return self.task_heads(candidates)
