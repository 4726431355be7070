"""The user code for exporting generative-recommenders' ``DlrmHSTU``: a factory that builds a small
ranker, and example inputs in the model's own format (two KeyedJaggedTensors).

Nothing of generative-recommenders is edited or copied: the configuration values are ours (a small
version of the shape of its KuaiRand config). Put a checkout of meta-recsys/generative-recommenders
on PYTHONPATH (or GR_SRC=path) before importing this module.
"""

from __future__ import annotations

import os
import sys
import types

import torch

if os.environ.get("GR_SRC"):
    sys.path.insert(0, os.environ["GR_SRC"])

# Workaround, not ours to fix: recent generative-recommenders imports
# torchrec.modules.sorted_index_select, which torchrec 1.8 does not have. Its forward is index_select;
# DlrmHSTU's inference path never calls it, the import only has to succeed.
try:
    import torchrec.modules.sorted_index_select  # noqa: F401
except ImportError:
    _stub = types.ModuleType("torchrec.modules.sorted_index_select")
    _stub.maybe_sorted_index_select = lambda e, i, use_sorted=False: e.index_select(0, i)  # type: ignore[attr-defined]
    _stub.sorted_index_select = lambda e, i: e.index_select(0, i)  # type: ignore[attr-defined]
    sys.modules[_stub.__name__] = _stub

from generative_recommenders.common import HammerKernel
from generative_recommenders.modules.dlrm_hstu import DlrmHSTU, DlrmHSTUConfig
from generative_recommenders.modules.multitask_module import MultitaskTaskType, TaskConfig
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

UIH = ["user_id", "user_active_degree", "video_id", "action_timestamp", "action_weight", "watch_time"]
CANDIDATES = ["item_video_id", "item_action_weight", "item_target_watchtime", "item_query_time"]


def build_ranker(dim: int = 32, heads: int = 2, layers: int = 2, seed: int = 0, *, head_dim: int = 16,
                 max_seq_len: int = 64, max_candidates: int = 8, preprocessor_dim: int | None = None,
                 items: int = 1000) -> DlrmHSTU:
    """A small DlrmHSTU by default; ``build_ranker(512, 4, 5, head_dim=128, preprocessor_dim=256, ...)`` has
    the dense shape of generative-recommenders' DLRMv3 configuration (small tables)."""
    cfg = DlrmHSTUConfig(
        max_seq_len=max_seq_len, max_num_candidates=max_candidates, hstu_num_heads=heads,
        hstu_attn_linear_dim=head_dim, hstu_attn_qk_dim=head_dim, hstu_attn_num_layers=layers,
        hstu_embedding_table_dim=dim, hstu_preprocessor_hidden_dim=preprocessor_dim or dim,
        hstu_transducer_embedding_dim=dim, contextual_feature_to_max_length={"user_id": 1, "user_active_degree": 1},
        user_embedding_feature_names=["video_id", "user_id", "user_active_degree"],
        item_embedding_feature_names=["item_video_id"], uih_post_id_feature_name="video_id",
        uih_action_time_feature_name="action_timestamp", candidates_querytime_feature_name="item_query_time",
        uih_weight_feature_name="action_weight", candidates_weight_feature_name="item_action_weight",
        candidates_watchtime_feature_name="item_target_watchtime", hstu_uih_feature_names=UIH,
        hstu_candidate_feature_names=CANDIDATES, action_weights=[1, 2, 4, 8],
        merge_uih_candidate_feature_mapping=[("video_id", "item_video_id"), ("action_timestamp", "item_query_time"),
                                             ("action_weight", "item_action_weight"),
                                             ("watch_time", "item_target_watchtime")],
        multitask_configs=[TaskConfig("is_click", 1, MultitaskTaskType.BINARY_CLASSIFICATION),
                           TaskConfig("is_like", 2, MultitaskTaskType.BINARY_CLASSIFICATION)],
    )
    tables = {name: EmbeddingConfig(num_embeddings=rows, embedding_dim=dim, name=name, feature_names=features)
              for name, rows, features in [("video_id", items, ["video_id", "item_video_id"]),
                                           ("user_id", 100, ["user_id"]), ("user_active_degree", 8, ["user_active_degree"])]}
    torch.manual_seed(seed)
    model = DlrmHSTU(cfg, tables, is_inference=True, bf16_training=False)
    model._embedding_collection.to_empty(device="cpu")  # the library builds its tables on the meta device
    for table in model._embedding_collection.parameters():
        torch.nn.init.uniform_(table.data, -0.05, 0.05)
    model.set_hammer_kernel(HammerKernel.PYTORCH)  # plain PyTorch ops; hstu-export maps them back to Triton on CUDA
    return model.eval()


def example_inputs(history: list[int], candidates: list[int], seed: int = 0) -> tuple[KeyedJaggedTensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    b, n, c = len(history), sum(history), sum(candidates)
    uih = [torch.randint(0, 100, (b,), generator=gen), torch.randint(0, 8, (b,), generator=gen),
           torch.randint(0, 1000, (n,), generator=gen), 1_700_000_000 + torch.randint(0, 10**6, (n,), generator=gen),
           torch.randint(0, 16, (n,), generator=gen), torch.randint(0, 100, (n,), generator=gen)]
    cand = [torch.randint(0, 1000, (c,), generator=gen), torch.zeros(c, dtype=torch.int64),
            torch.zeros(c, dtype=torch.int64), torch.full((c,), 1_702_000_000)]
    ones = [1] * b
    return (KeyedJaggedTensor.from_lengths_sync(UIH, torch.cat(uih), torch.tensor(ones * 2 + history * 4)),
            KeyedJaggedTensor.from_lengths_sync(CANDIDATES, torch.cat(cand), torch.tensor(candidates * 4)))
