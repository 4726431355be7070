"""The zoo ranking model on new tokens only, against cached per-layer K/V (the delta path).

A user's sequence is ``contextual ⊕ history ⊕ candidates``. Non-target tokens never attend to later
tokens, except contextual ones, which see the whole history: so with no contextual tokens, or an
unchanged history, the K/V of every layer for a prefix of the sequence is what a full run would
compute, and a request need only run its new tokens (fresh history and candidates) through the layers,
attending to the cached keys (:mod:`hstu_export.ops.paged`). Exact under three conditions, which the
cache (:mod:`hstu_export.serving.kv_cache`) checks before it reuses an entry:

1. the attention scale is fixed (``scaling_seqlen`` of the config, the default: ``max_seq_len``); a model
   that scales by the batch's longest sequence would scale the delta rows by a different length;
2. the cached tokens are a prefix of the request's, contextual features included, and with contextual
   tokens the history has not grown (they would see the new history);
3. every cached history token falls in the same timestamp bucket at the request's ``query_time`` as
   when it was computed (the bucket is log(query_time - t)).

Calling :meth:`DeltaRanker.run` with nothing cached (``cached == 0``) is the prefill: the same code.
A run writes the K/V of its new non-target tokens into the pages itself, where the page table says: each
layer's attention stores them (:func:`hstu_export.ops.paged.paged_hstu_mha_store`); tokens that are not to
be kept get the pool's scratch page in their table row.
A delta request carries only the history after the cached prefix; the cache's owner slices it. The
contextual tokens of a user with a cached prefix are cached too, so :meth:`DeltaRanker.dense` takes the
contextual embeddings of the users with nothing cached only: every size of a delta run then follows
from the sizes of its inputs, and :class:`DeltaProgram` (the same computation with tensors in and out)
exports with dynamic shapes (:mod:`hstu_export.kv_export`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hstu_export.models.ranking import CANDIDATE_LENGTHS, HISTORY_LENGTHS, HstuRankingModel
from hstu_export.models.stu import LAYER_NORM_EPS, layer_norm_fp32
from hstu_export.models.transducer import time_buckets, token_positions
from hstu_export.ops.jagged import jagged_positions_by_search, lengths_to_offsets
from hstu_export.ops.paged import delta_counts, paged_attention_inputs, paged_hstu_mha_store, scratch_page
from hstu_export.ops.reference import stu_gate

__all__ = ["PROGRAM_INPUTS", "DeltaPlan", "DeltaProgram", "DeltaRanker", "GatedAttention", "KVLayout", "ResidualNorm",
           "fit_counts", "fresh_contextual", "plan_on_device", "residual_then_norm", "scratch_page",
           "stacked_contextual"]


# (x, gated, output weight, next layer's norm weight, its bias) -> (x + gated @ weight, the next layer's input
# norm of that sum): what lies between two STU layers of the delta run.
ResidualNorm = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]

# A layer's attention and output gate in one call (the Triton program's: ops/_triton/paged.py's
# paged_hstu_mha_gated_store_triton): (uvqk, q_offsets, k_pages, v_pages, layer, page_table, seq_lens,
# num_targets, gate norm weight, its bias, eps, heads, attention_dim, linear_dim, scaling_seqlen, alpha,
# contextual_seq_len, max_attn_len, *, max_seq_len, max_query_len, target_rows) -> concat(SiLU(u), a,
# SiLU(u) * LN(a)), of the rows ``target_rows`` gives when it is not None (the targets', user by user: the last
# layer computes only those); it stores the new K/V as the attention does.
GatedAttention = Callable[..., Tensor]


def residual_then_norm(x: Tensor, gated: Tensor, weight: Tensor, norm_weight: Tensor,
                       norm_bias: Tensor) -> tuple[Tensor, Tensor]:  # fmt: skip
    """:data:`ResidualNorm` as the full model computes it (the sum an addmm, then :func:`layer_norm_fp32`): the
    default, and the aten program's."""
    x = x + gated @ weight
    return x, layer_norm_fp32(x, norm_weight, norm_bias)


@dataclass
class DeltaPlan:
    """A delta request's sizes and per-user counts (on the device): what :meth:`DeltaRanker.dense` needs
    besides tensors. Sizes are host ints (eager: computed once per request shape) or, inside an exported
    program, symbolic sizes of its inputs; the two maxima are bounds that size the attention's launch."""

    batch: Any  # int or SymInt
    total_new: Any
    total_cand: Any
    max_seq_len: int
    max_query_len: int
    on: dict[str, Tensor]
    # The counts per user (cached, new history, candidates; int64, none negative, the two token counts fitted
    # to their tables): what the attention's inputs are computed from, in one kernel (paged_attention_inputs).
    requested: tuple[Tensor, Tensor, Tensor]


def fit_counts(counts: Tensor, rows: Any) -> Tensor:
    """``counts`` [B] (int64, none negative) with each user's count cut where a table of ``rows`` rows runs out,
    the users taking their rows in order: unchanged when they add up to at most ``rows``. So a last user given
    ``rows`` (or more) tokens takes exactly the rows the others leave, which is what a shape bucket's padding
    user needs (runtimes/kv_graphs.py): its counts are then the same on every call, not computed per call.
    A scan over the users, which a compiled program runs in the kernel of the run's other scans of them."""
    ends = torch.cumsum(counts, 0)
    # Each user's end and start cut to the table (no slice of the scan: torch.export would then guard the
    # number of users away from 1 and 2).
    return ends.clamp(max=rows) - (ends - counts).clamp(max=rows)


def plan_on_device(cached: Tensor, new_hist: Tensor, cand_len: Tensor, n_hist: Any, n_cand: Any, n_ctx_rows: Any,
                   c: int, max_seq_len: int, max_query_len: int) -> DeltaPlan:
    """A plan from device tensors and the sizes of the request's token tables (history, candidates, the
    contextual rows of the users with nothing cached): no host read, so it traces with symbolic sizes. The
    history and candidate counts are fitted to their tables (:func:`fit_counts`)."""
    cached, new_hist, cand_len = (t.to(torch.int64).clamp(min=0) for t in (cached, new_hist, cand_len))
    new_hist, cand_len = fit_counts(new_hist, n_hist), fit_counts(cand_len, n_cand)
    on = delta_counts(cached, new_hist, cand_len, c)
    return DeltaPlan(batch=cached.shape[0], total_new=n_hist + n_cand + n_ctx_rows,
                     total_cand=n_cand, max_seq_len=max_seq_len, max_query_len=max_query_len, on=on,
                     requested=(cached, new_hist, cand_len))


@dataclass(frozen=True)
class KVLayout:
    """What a cache of the model's K/V needs to know of it: the pages' shape and dtype, and what makes a
    cached prefix reusable (contextual features, the time buckets' parameters). Recorded in a package's
    manifest (``kv_cache``), so that a package's cache is laid out without the model."""

    num_layers: int
    num_heads: int
    attention_dim: int
    linear_dim: int
    contextual_features: tuple[str, ...]
    time_bucket_base: float
    num_time_buckets: int
    dtype: torch.dtype

    @property
    def contextual_seq_len(self) -> int:
        return len(self.contextual_features)

    @classmethod
    def of(cls, model: HstuRankingModel) -> KVLayout:
        cfg, enc = model.config, model.transducer.positional_encoder
        return cls(cfg.num_layers, cfg.num_heads, cfg.attention_dim, cfg.linear_dim, tuple(cfg.contextual_features),
                   float(enc.time_bucket_base), int(enc.num_time_buckets), model.transducer.post_norm_weight.dtype)


class DeltaRanker:
    """Runs :class:`~hstu_export.models.ranking.HstuRankingModel` on the new tokens of each user."""

    def __init__(self, model: HstuRankingModel, attention: Callable[..., Tensor] = paged_hstu_mha_store,
                 attention_inputs: Callable[..., tuple[Tensor, ...]] = paged_attention_inputs,
                 residual: ResidualNorm | None = None, heads: Callable[[Tensor], dict[str, Tensor]] | None = None,
                 gated_attention: GatedAttention | None = None) -> None:
        self.model = model
        # The task heads on the candidates' rows: the model's own, or the same computation in other kernels (an
        # exported program's: passes/fuse_parallel_mlps.py).
        self.heads = heads or model.task_heads
        self.config = model.config
        self.transducer = model.transducer
        self.dtype = self.transducer.post_norm_weight.dtype
        self.layout = KVLayout.of(model)
        # paged_hstu_mha_store's signature and contract (it stores the new K/V); an exported program fixes it,
        # and the function that computes its inputs (paged_attention_inputs's signature)
        self.attention = attention
        self.attention_inputs = attention_inputs
        self.residual = residual or residual_then_norm  # between two layers (see ResidualNorm)
        # None: the attention, then the gate (stu_gate); else both in one call (see GatedAttention)
        self.gated_attention = gated_attention

    @torch.no_grad()
    def run(
        self,
        features: dict[str, Tensor],
        cached: Tensor,
        k_pages: Tensor,
        v_pages: Tensor,
        page_table: Tensor,
    ) -> dict[str, Tensor]:
        """One delta request: the model's outputs; the new non-target tokens' K/V written into the pages.
        ``cached`` [B] (host): tokens of each user in the cache, 0 or contextual + a history prefix.
        ``features``: the request as the model takes it, except that each user's history holds only the
        tokens after the cached prefix (``uih_lengths`` counts those). ``k_pages``/``v_pages``
        [layers, P, page, H, D] and ``page_table`` [B, pages] as in :mod:`hstu_export.ops.paged`; each user's
        row covers its cached and new non-target tokens, or is the scratch page where they are not kept."""
        emb = self.model.sparse_arch(features)
        plan = self.plan(features, cached, page_table.device)
        return self.dense(fresh_contextual(emb, self.config.contextual_features, cached), features, plan, k_pages,
                          v_pages, page_table)

    def plan(self, features: dict[str, Tensor], cached: Tensor, device: torch.device) -> DeltaPlan:
        """Sizes and per-user counts of a delta request, from its (host) lengths."""
        c = self.config.contextual_seq_len
        counts = delta_counts(cached.cpu().to(torch.int64), features[HISTORY_LENGTHS].cpu().to(torch.int64),
                              features[CANDIDATE_LENGTHS].cpu().to(torch.int64), c)
        on = {name: t.to(device) for name, t in counts.items()}
        return DeltaPlan(
            batch=counts["cached"].numel(), total_new=int(counts["new_len"].sum()),
            total_cand=int(counts["cand_len"].sum()),
            max_seq_len=int(counts["seq_len"].max()), max_query_len=int(counts["new_len"].max()),
            on=on, requested=(on["cached"], on["new_hist"], on["cand_len"]),
        )  # fmt: skip

    @torch.no_grad()
    def dense(self, emb: dict[str, Tensor], features: dict[str, Tensor], plan: DeltaPlan, k_pages: Tensor,
              v_pages: Tensor, page_table: Tensor) -> dict[str, Tensor]:
        """The dense half of :meth:`run` on the sparse half's embeddings, the contextual ones of the users
        with nothing cached only (:func:`fresh_contextual`); each layer's attention writes the new K/V into
        the pages (in place). Device work only (no sync, no host copy, no size read from a tensor), so a CUDA
        graph can capture it and torch.export can trace it."""
        cfg, tr = self.config, self.transducer
        c = cfg.contextual_seq_len
        on, total_new = plan.on, plan.total_new
        max_seq_len, max_query_len = plan.max_seq_len, plan.max_query_len

        # The new tokens of each user, in sequence order: contextual (nothing cached), the history past
        # the cached prefix, candidates. Each is a row of one table of all token values.
        pre = tr.preprocessor
        hist_tokens = pre.history_proj(torch.cat([emb["uih_item_emb"], emb["uih_action_emb"]], -1).to(self.dtype))
        cand_tokens = pre.candidate_proj(emb["candidate_item_emb"].to(self.dtype))
        parts = [hist_tokens, cand_tokens]
        if c > 0:
            ctx = torch.stack([proj(emb[f"{name}_emb"].to(self.dtype))
                               for proj, name in zip(pre.contextual_proj, cfg.contextual_features)], dim=1)
            parts.append(ctx.flatten(0, 1))
        table = torch.cat(parts)
        fresh_rank = torch.cumsum((on["ctx_new"] > 0).to(torch.int64), 0) - 1  # row among the contextual users
        # Every data-dependent index below is clamped into its table: counts that disagree with the sizes of
        # the inputs (a caller's mistake, or the made-up values a compiler runs a kernel on while it tunes
        # it) give wrong numbers, never a read outside a tensor.
        #
        # Each token's user by a search of the offsets (one fused kernel; repeat_interleave is three, and
        # calls that do not fuse): users and indices within their rows, kept in range (see the function).
        q_offsets = lengths_to_offsets(on["new_len"])
        user, r = jagged_positions_by_search(q_offsets, total_new)  # r: index among the user's new tokens
        index = on["cached"][user] + r  # index in the user's whole sequence
        is_ctx = r < on["ctx_new"][user]
        is_cand = r >= (on["ctx_new"] + on["new_hist"])[user]
        hist_off, cand_off = lengths_to_offsets(on["new_hist"]), lengths_to_offsets(on["cand_len"])
        hist_row = hist_off[:-1][user] + (r - on["ctx_new"][user]).clamp(min=0)  # where the token is history
        cand_row = cand_off[:-1][user] + (r - on["ctx_new"][user] - on["new_hist"][user]).clamp(min=0)
        n_hist, n_cand = hist_tokens.size(0), cand_tokens.size(0)
        is_hist = ~is_ctx & ~is_cand
        # Each branch's index is valid where it is chosen; elsewhere it points at row 0 (never read).
        ctx_row = torch.where(is_ctx, n_hist + n_cand + fresh_rank[user] * c + r.clamp(max=max(c - 1, 0)), 0)
        row = torch.where(is_ctx, ctx_row, torch.where(is_cand, n_hist + cand_row, torch.where(is_hist, hist_row, 0)))
        tokens = table[row.clamp(0, table.shape[0] - 1)]

        # Positional encoding of the new tokens, by their index in the whole sequence.
        enc = tr.positional_encoder
        pos = token_positions(index, (on["seq_len"] - on["cand_len"])[user], c, enc.max_seq_len)
        stamps = features["uih_timestamps"]
        # One pad entry: non-history tokens read it (an empty history has no entry to point at).
        timestamps = torch.cat([stamps, stamps.new_zeros(1)])[torch.where(is_hist, hist_row, n_hist).clamp(0, n_hist)]
        buckets = time_buckets(features["query_time"][user], timestamps, enc.time_bucket_base,
                               enc.num_time_buckets)
        bucket = torch.where(is_hist, buckets, 0)
        pos = pos.clamp(0, enc.position_emb.shape[0] - 1)
        bucket = bucket.clamp(0, enc.time_emb.shape[0] - 1)
        x = tokens * enc.scale + F.embedding(pos, enc.position_emb) + F.embedding(bucket, enc.time_emb)

        # Rows of the candidates, gathered without a device sync.
        cand_user, cand_r = jagged_positions_by_search(cand_off, plan.total_cand)
        cand_rows = ((q_offsets[1:] - on["cand_len"])[cand_user] + cand_r).clamp(0, total_new - 1)

        # What the attention kernel walks, kept inside its tensors: query rows within the new tokens, keys
        # within the page table's width, pages within the cache. Computed once for every layer, from the
        # request's counts as given (an exported program's inputs: nothing to copy for each layer).
        att_offsets, att_seq_len, att_targets, att_pages = self.attention_inputs(
            *plan.requested, page_table, c, total_new, k_pages.shape[2], k_pages.shape[1])

        # The STU layers on the new rows; each layer's attention stores the new non-target tokens' K/V. Each
        # layer's input norm comes with the residual sum of the layer before (self.residual), the first's alone.
        # The last layer's output is read at the candidates' rows only, so past its projection (every row's K/V
        # is stored) it computes those rows alone: its attention, gate, output product and residual.
        layers = list(tr.stu.layers)
        n = layer_norm_fp32(x, layers[0].input_norm_weight, layers[0].input_norm_bias) if layers else x
        for number, layer in enumerate(layers):
            last = number + 1 == len(layers)
            h, dqk, dv = layer.num_heads, layer.attention_dim, layer.linear_dim
            uvqk = torch.addmm(layer.uvqk_bias, n, layer.uvqk_weight)
            if self.gated_attention is not None:
                gated = self.gated_attention(
                    uvqk, att_offsets, k_pages, v_pages, number, att_pages, att_seq_len, att_targets,
                    layer.output_norm_weight, layer.output_norm_bias, LAYER_NORM_EPS, h, dqk, dv,
                    cfg.attn_scaling_seqlen, cfg.attn_alpha, c, cfg.max_attn_len, max_seq_len=max_seq_len,
                    max_query_len=max_query_len, target_rows=cand_rows if last else None,
                )  # fmt: skip
            else:
                u, v, q, k = torch.split(uvqk, [dv * h, dv * h, dqk * h, dqk * h], dim=-1)
                # Views into uvqk (head dim contiguous): the kernel takes their strides, so no copy.
                q, k, v = q.unflatten(-1, (h, dqk)), k.unflatten(-1, (h, dqk)), v.unflatten(-1, (h, dv))
                a = self.attention(
                    q, k, v, att_offsets, k_pages, v_pages, number, att_pages, att_seq_len, att_targets,
                    cfg.attn_scaling_seqlen, cfg.attn_alpha, c, cfg.max_attn_len, max_seq_len=max_seq_len,
                    max_query_len=max_query_len,
                ).reshape(-1, h * dv)  # fmt: skip
                if last:
                    u, a = u[cand_rows], a[cand_rows]
                gated = stu_gate(u, a, layer.output_norm_weight, layer.output_norm_bias, LAYER_NORM_EPS)
            if not last:
                following = layers[number + 1]
                x, n = self.residual(x, gated, layer.output_weight, following.input_norm_weight,
                                     following.input_norm_bias)
            else:
                x = x[cand_rows] + gated @ layer.output_weight

        candidates = x if layers else x[cand_rows]
        if cfg.postprocessor == "l2norm":
            candidates = F.normalize(candidates, p=2.0, dim=-1, eps=1e-6)
        else:
            candidates = layer_norm_fp32(candidates, tr.post_norm_weight, tr.post_norm_bias)
        return self.heads(candidates)


def fresh_contextual(emb: dict[str, Tensor], names: Sequence[str], cached: Tensor) -> dict[str, Tensor]:
    """``emb`` with each contextual feature's embeddings kept for the users with nothing cached only (the
    others' contextual tokens are in the cache): what :meth:`DeltaRanker.dense` takes."""
    if not names:
        return emb
    fresh = (cached.to(torch.int64) == 0).nonzero()[:, 0]
    return {**emb, **{f"{name}_emb": emb[f"{name}_emb"].index_select(0, fresh.to(emb[f"{name}_emb"].device))
                      for name in names}}


class DeltaProgram(nn.Module):
    """The delta run as a module of tensors in, tensors out: what the package's ``kv_delta`` program is.

    Inputs, in this order (:data:`PROGRAM_INPUTS`): the sparse half's history, action and candidate
    embeddings; ``contextual_emb`` [F, contextual features, D], the contextual embeddings of the F users
    with nothing cached, in batch order; ``uih_lengths`` (history tokens past the cached prefix),
    ``candidate_lengths``, ``uih_timestamps`` (of those history tokens), ``query_time``; ``kv_cached`` [B]
    (cached tokens per user, 0: prefill), ``kv_k_pages``/``kv_v_pages`` [layers, pages, page, H, D] and
    ``kv_page_table`` [B, W]. Outputs: the model's; the new non-target tokens' K/V are written into
    ``kv_k_pages``/``kv_v_pages`` (the program mutates those inputs). ``max_seq_len`` and
    ``max_query_len`` are the exported bounds: a user's whole sequence, and its new tokens."""

    def __init__(self, model: HstuRankingModel, attention: Callable[..., Tensor], max_seq_len: int,
                 max_query_len: int, attention_inputs: Callable[..., tuple[Tensor, ...]] = paged_attention_inputs,
                 residual: ResidualNorm | None = None, heads: nn.Module | None = None,
                 gated_attention: GatedAttention | None = None) -> None:
        super().__init__()
        self.model = model
        self.heads = heads  # a submodule, so that its tensors are the program's
        self.delta = DeltaRanker(model, attention, attention_inputs, residual, heads, gated_attention)
        self.max_seq_len, self.max_query_len = max_seq_len, max_query_len

    def forward(self, uih_item_emb: Tensor, uih_action_emb: Tensor, candidate_item_emb: Tensor, contextual_emb: Tensor,
                uih_lengths: Tensor, candidate_lengths: Tensor, uih_timestamps: Tensor, query_time: Tensor,
                kv_cached: Tensor, kv_k_pages: Tensor, kv_v_pages: Tensor, kv_page_table: Tensor) -> dict[str, Tensor]:
        cfg = self.model.config
        c = cfg.contextual_seq_len
        plan = plan_on_device(kv_cached, uih_lengths, candidate_lengths, uih_item_emb.shape[0],
                              candidate_item_emb.shape[0], contextual_emb.shape[0] * c, c, self.max_seq_len,
                              self.max_query_len)  # fmt: skip
        emb = {"uih_item_emb": uih_item_emb, "uih_action_emb": uih_action_emb, "candidate_item_emb": candidate_item_emb,
               **{f"{name}_emb": contextual_emb[:, i] for i, name in enumerate(cfg.contextual_features)}}
        features = {"uih_timestamps": uih_timestamps, "query_time": query_time}
        return self.delta.dense(emb, features, plan, kv_k_pages, kv_v_pages, kv_page_table)


# The delta program's inputs, in order.
PROGRAM_INPUTS = ("uih_item_emb", "uih_action_emb", "candidate_item_emb", "contextual_emb", HISTORY_LENGTHS,
                  CANDIDATE_LENGTHS, "uih_timestamps", "query_time", "kv_cached", "kv_k_pages", "kv_v_pages",
                  "kv_page_table")


def stacked_contextual(emb: dict[str, Tensor], names: Sequence[str], cached: Tensor, like: Tensor) -> Tensor:
    """The ``contextual_emb`` input of :class:`DeltaProgram`: [F, len(names), D] for the users with nothing
    cached (``like`` gives dtype, device and D when there are no contextual features)."""
    if not names:
        return like.new_zeros((0, 0, like.shape[-1]))
    fresh = fresh_contextual(emb, names, cached)
    return torch.stack([fresh[f"{name}_emb"] for name in names], dim=1)
