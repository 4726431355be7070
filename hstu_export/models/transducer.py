"""HSTU transducer: preprocessor → positional encoder → STU stack → candidate rows → postprocessor.

Inputs are the dense side of the model: embedding values that crossed the sparse boundary plus the
per-user lengths and timestamps. Everything is jagged (values + per-user lengths); the per-user
sequence is ``contextual tokens ⊕ history ⊕ candidates`` and candidates are the attention's targets.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hstu_export.models.config import HSTUConfig
from hstu_export.models.stu import STUStack, layer_norm_fp32
from hstu_export.ops import Kernel, concat_2D_jagged, jagged_positions, lengths_to_offsets, split_2D_jagged


class ContextualPreprocessor(nn.Module):
    """Turns embeddings into tokens of width D and lays out each user's sequence.

    history token = Linear(item ⊕ action), candidate token = Linear(item), contextual token =
    per-feature Linear(embedding); all have width D.
    """

    def __init__(self, config: HSTUConfig) -> None:
        super().__init__()
        d = config.embedding_dim
        self.kernel = Kernel(config.kernel)
        self.history_proj = nn.Linear(2 * d, d)
        self.candidate_proj = nn.Linear(d, d)
        self.contextual_proj = nn.ModuleList([nn.Linear(d, d) for _ in config.contextual_features])

    def forward(
        self,
        history_item: Tensor,
        history_action: Tensor,
        candidate_item: Tensor,
        contextual: list[Tensor],
        history_offsets: Tensor,
        candidate_offsets: Tensor,
    ) -> tuple[Tensor, Tensor]:
        """Returns (tokens [L, D], offsets of the ``history ⊕ candidates`` part, without context)."""
        history = self.history_proj(torch.cat([history_item, history_action], dim=-1))
        candidates = self.candidate_proj(candidate_item)
        tokens = concat_2D_jagged(history, history_offsets, candidates, candidate_offsets, kernel=self.kernel)
        offsets = history_offsets + candidate_offsets
        if len(self.contextual_proj) > 0:
            # [B, c, D] flattened: every user gets the same number c of contextual tokens.
            ctx = torch.stack([proj(e) for proj, e in zip(self.contextual_proj, contextual)], dim=1)
            ctx_offsets = torch.arange(
                offsets.numel(), device=offsets.device, dtype=offsets.dtype
            ) * len(self.contextual_proj)
            tokens = concat_2D_jagged(ctx.flatten(0, 1), ctx_offsets, tokens, offsets, kernel=self.kernel)
            offsets = offsets + ctx_offsets
        return tokens, offsets


def token_positions(index: Tensor, first_target: Tensor, contextual_seq_len: int, max_seq_len: int) -> Tensor:
    """Position embeddings' index of tokens at ``index`` in their sequence, whose first target is at
    ``first_target`` (per token): contextual tokens share 0, history counts up, every candidate takes
    the position right after the history; clamped to the table."""
    c = contextual_seq_len
    pos = torch.clamp(index - (c - 1), min=0) if c > 0 else index
    pos = torch.minimum(pos, first_target - max(c - 1, 0))
    return torch.clamp(pos, max=max_seq_len - 1)


def time_buckets(query_time: Tensor, timestamps: Tensor, base: float, num_buckets: int) -> Tensor:
    """Timestamp bucket of history tokens: log(query_time - t) / base, in [0, num_buckets)."""
    delta = (query_time - timestamps).clamp(min=1).to(torch.float32)
    return (torch.log(delta) / base).to(torch.int64).clamp(min=0, max=num_buckets - 1)


# Beyond any time difference a request can hold: the bounds of the first and the last bucket.
UNBOUNDED = 1 << 62


@functools.cache
def bucket_edges(base: float, num_buckets: int) -> Tensor:
    """``edges`` [num_buckets + 1] such that :func:`time_buckets` gives bucket ``k`` exactly for the time
    differences ``d`` with ``edges[k] <= d < edges[k + 1]`` (``-UNBOUNDED`` and ``UNBOUNDED`` at the ends; a
    bucket that no difference reaches has the next one's edge). The bucket is a non-decreasing function of
    ``d`` (each of its steps is), so each edge is found by a binary search over ``d`` with that same
    function: float32 rounding included, and without inverting the logarithm."""
    wanted = torch.arange(1, num_buckets, dtype=torch.int64)
    lo = torch.ones_like(wanted)  # bucket(lo) < k, or lo is the edge
    hi = torch.full_like(wanted, UNBOUNDED)  # bucket(hi) >= k, or UNBOUNDED: k is not reached
    zero = torch.zeros_like(wanted)
    for _ in range(UNBOUNDED.bit_length()):
        mid = (lo + hi) // 2
        reached = time_buckets(mid, zero, base, num_buckets) >= wanted
        hi = torch.where(reached, mid, hi)
        lo = torch.where(reached, lo, mid + 1)
    edges = torch.where(time_buckets(lo, zero, base, num_buckets) >= wanted, lo, UNBOUNDED)
    return torch.cat([edges.new_tensor([-UNBOUNDED]), edges, edges.new_tensor([UNBOUNDED])])


class PositionalEncoder(nn.Module):
    """x·sqrt(D) + position embedding + timestamp-bucket embedding.

    Positions follow the attention's rule: contextual tokens share position 0, history counts up, all
    candidates share the position right after the history. The timestamp bucket is
    log(query_time − t) / base for history tokens and bucket 0 for contextual and candidate tokens.
    """

    def __init__(self, config: HSTUConfig) -> None:
        super().__init__()
        self.kernel = Kernel(config.kernel)
        self.max_seq_len = config.max_seq_len
        self.contextual_seq_len = config.contextual_seq_len
        self.num_time_buckets = config.num_time_buckets
        self.time_bucket_base = config.time_bucket_base
        self.scale = math.sqrt(config.embedding_dim)
        self.position_emb = nn.Parameter(torch.empty(config.max_seq_len, config.embedding_dim))
        self.time_emb = nn.Parameter(torch.empty(config.num_time_buckets, config.embedding_dim))
        nn.init.normal_(self.position_emb, std=0.02)
        nn.init.normal_(self.time_emb, std=0.02)

    def forward(
        self,
        tokens: Tensor,
        offsets: Tensor,
        num_targets: Tensor,
        history_offsets: Tensor,
        history_timestamps: Tensor,
        query_time: Tensor,
    ) -> Tensor:
        total = tokens.size(0)
        seq, pos = jagged_positions(offsets, total, kernel=self.kernel)
        lengths = offsets[1:] - offsets[:-1]
        c = self.contextual_seq_len
        pos = token_positions(pos, (lengths - num_targets)[seq], c, self.max_seq_len)

        # Timestamp bucket of each history token; other tokens keep bucket 0.
        hist_total = history_timestamps.size(0)
        hist_seq, hist_pos = jagged_positions(history_offsets, hist_total, kernel=self.kernel)
        hist_bucket = time_buckets(query_time[hist_seq], history_timestamps, self.time_bucket_base,
                                   self.num_time_buckets)
        # A history token sits after its user's contextual tokens.
        bucket = torch.zeros(total, dtype=torch.int64, device=tokens.device)
        bucket = bucket.index_put((offsets[:-1][hist_seq] + c + hist_pos,), hist_bucket)

        return tokens * self.scale + F.embedding(pos, self.position_emb) + F.embedding(bucket, self.time_emb)


class HSTUTransducer(nn.Module):
    """Dense HSTU: tokens → STU stack → candidate rows → postprocessor. Returns [num_candidates, D]."""

    def __init__(self, config: HSTUConfig) -> None:
        super().__init__()
        self.config = config
        self.kernel = Kernel(config.kernel)
        self.preprocessor = ContextualPreprocessor(config)
        self.positional_encoder = PositionalEncoder(config)
        self.stu = STUStack(config)
        self.post_norm_weight = nn.Parameter(torch.ones(config.embedding_dim))
        self.post_norm_bias = nn.Parameter(torch.zeros(config.embedding_dim))

    def forward(
        self,
        history_item: Tensor,
        history_action: Tensor,
        candidate_item: Tensor,
        contextual: list[Tensor],
        history_lengths: Tensor,
        candidate_lengths: Tensor,
        history_timestamps: Tensor,
        query_time: Tensor,
    ) -> Tensor:
        history_offsets = lengths_to_offsets(history_lengths)
        candidate_offsets = lengths_to_offsets(candidate_lengths)
        tokens, offsets = self.preprocessor(
            history_item, history_action, candidate_item, contextual, history_offsets, candidate_offsets
        )
        x = self.positional_encoder(
            tokens, offsets, candidate_lengths, history_offsets, history_timestamps, query_time
        )
        x = self.stu(x, offsets, candidate_lengths)
        num_candidates = candidate_item.size(0)
        _, candidates = split_2D_jagged(
            x,
            offsets - candidate_offsets,
            candidate_offsets,
            total_len_left=x.size(0) - num_candidates,
            total_len_right=num_candidates,
            kernel=self.kernel,
        )
        if self.config.postprocessor == "l2norm":
            return F.normalize(candidates, p=2.0, dim=-1, eps=1e-6)
        return layer_norm_fp32(candidates, self.post_norm_weight, self.post_norm_bias)
