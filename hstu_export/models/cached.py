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
A delta request carries only the history after the cached prefix; the cache's owner slices it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from hstu_export.models.ranking import CANDIDATE_LENGTHS, HISTORY_LENGTHS, HstuRankingModel
from hstu_export.models.stu import LAYER_NORM_EPS, layer_norm_fp32
from hstu_export.models.transducer import time_buckets, token_positions
from hstu_export.ops.jagged import lengths_to_offsets
from hstu_export.ops.paged import paged_hstu_mha
from hstu_export.ops.reference import stu_gate

__all__ = ["DeltaOutputs", "DeltaPlan", "DeltaRanker"]


@dataclass
class DeltaPlan:
    """A delta request's sizes (host ints) and per-user counts (on the device): what :meth:`DeltaRanker.dense`
    needs besides tensors; computed once per request shape."""

    batch: int
    total_new: int
    total_kept: int
    total_cand: int
    max_seq_len: int
    max_query_len: int
    on: dict[str, Tensor]


@dataclass
class DeltaOutputs:
    """What one delta run gives: the model's outputs, and the K/V of the new non-target tokens for the
    cache (``[layers, T, H, D]``, token t is position ``positions[t]`` of batch row ``users[t]``)."""

    outputs: dict[str, Tensor]
    new_k: Tensor
    new_v: Tensor
    users: Tensor
    positions: Tensor


class DeltaRanker:
    """Runs :class:`~hstu_export.models.ranking.HstuRankingModel` on the new tokens of each user."""

    def __init__(self, model: HstuRankingModel) -> None:
        self.model = model
        self.config = model.config
        self.transducer = model.transducer
        self.dtype = self.transducer.post_norm_weight.dtype

    @torch.no_grad()
    def run(
        self,
        features: dict[str, Tensor],
        cached: Tensor,
        k_pages: Tensor,
        v_pages: Tensor,
        page_table: Tensor,
    ) -> DeltaOutputs:
        """One delta request. ``cached`` [B] (host): tokens of each user in the cache, 0 or contextual + a
        history prefix. ``features``: the request as the model takes it, except that each user's history
        holds only the tokens after the cached prefix (``uih_lengths`` counts those). ``k_pages``/``v_pages``
        [layers, P, page, H, D] and ``page_table`` [B, pages] as in :mod:`hstu_export.ops.paged`."""
        emb = self.model.sparse_arch(features)
        plan = self.plan(features, cached, page_table.device)
        return self.dense(emb, features, plan, k_pages, v_pages, page_table)

    def plan(self, features: dict[str, Tensor], cached: Tensor, device: torch.device) -> DeltaPlan:
        """Sizes and per-user counts of a delta request, from its (host) lengths."""
        c = self.config.contextual_seq_len
        cached = cached.cpu().to(torch.int64)
        new_hist = features[HISTORY_LENGTHS].cpu().to(torch.int64)
        cand_len = features[CANDIDATE_LENGTHS].cpu().to(torch.int64)
        ctx_new = torch.where(cached == 0, c, 0)
        new_len = ctx_new + new_hist + cand_len
        seq_len = cached + new_len
        kept_len = ctx_new + new_hist  # new non-target tokens, whose K/V go to the cache
        counts = {"cached": cached, "ctx_new": ctx_new, "new_len": new_len, "seq_len": seq_len, "cand_len": cand_len,
                  "new_hist": new_hist, "kept_len": kept_len}
        return DeltaPlan(
            batch=new_hist.numel(), total_new=int(new_len.sum()), total_kept=int(kept_len.sum()),
            total_cand=int(cand_len.sum()), max_seq_len=int(seq_len.max()), max_query_len=int(new_len.max()),
            on={name: t.to(device) for name, t in counts.items()},
        )  # fmt: skip

    @torch.no_grad()
    def dense(self, emb: dict[str, Tensor], features: dict[str, Tensor], plan: DeltaPlan, k_pages: Tensor,
              v_pages: Tensor, page_table: Tensor) -> DeltaOutputs:
        """The dense half of :meth:`run` on the sparse half's embeddings. Device work only (no sync, no
        host copy), so a CUDA graph can capture it for one plan's shapes."""
        cfg, tr = self.config, self.transducer
        device = page_table.device
        c = cfg.contextual_seq_len
        on, batch, total_new, total_kept = plan.on, plan.batch, plan.total_new, plan.total_kept
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
        users = torch.arange(batch, device=device)
        user = torch.repeat_interleave(users, on["new_len"], output_size=total_new)
        q_offsets = lengths_to_offsets(on["new_len"])
        r = torch.arange(total_new, device=device) - q_offsets[:-1][user]  # index among the user's new tokens
        index = on["cached"][user] + r  # index in the user's whole sequence
        is_ctx = r < on["ctx_new"][user]
        is_cand = r >= (on["ctx_new"] + on["new_hist"])[user]
        hist_off, cand_off = lengths_to_offsets(on["new_hist"]), lengths_to_offsets(on["cand_len"])
        hist_row = hist_off[:-1][user] + (r - on["ctx_new"][user]).clamp(min=0)  # where the token is history
        cand_row = cand_off[:-1][user] + (r - on["ctx_new"][user] - on["new_hist"][user]).clamp(min=0)
        n_hist, n_cand = hist_tokens.size(0), cand_tokens.size(0)
        row = torch.where(is_ctx, n_hist + n_cand + user * c + r.clamp(max=max(c - 1, 0)),
                          torch.where(is_cand, n_hist + cand_row, hist_row.clamp(max=max(n_hist - 1, 0))))
        tokens = table[row]

        # Positional encoding of the new tokens, by their index in the whole sequence.
        enc = tr.positional_encoder
        pos = token_positions(index, (on["seq_len"] - on["cand_len"])[user], c, enc.max_seq_len)
        is_hist = ~is_ctx & ~is_cand
        stamps = features["uih_timestamps"]
        timestamps = stamps[hist_row.clamp(max=max(stamps.numel() - 1, 0))] if stamps.numel() else hist_row
        buckets = time_buckets(features["query_time"][user], timestamps, enc.time_bucket_base,
                               enc.num_time_buckets)
        bucket = torch.where(is_hist, buckets, 0)
        x = tokens * enc.scale + F.embedding(pos, enc.position_emb) + F.embedding(bucket, enc.time_emb)

        # Rows of the new non-target tokens and of the candidates, gathered without a device sync.
        kept_user = torch.repeat_interleave(users, on["kept_len"], output_size=total_kept)
        kept = q_offsets[:-1][kept_user] + torch.arange(total_kept, device=device) - lengths_to_offsets(
            on["kept_len"])[:-1][kept_user]
        cand_user = torch.repeat_interleave(users, on["cand_len"], output_size=plan.total_cand)
        cand_rows = (q_offsets[1:] - on["cand_len"])[cand_user] + torch.arange(cand_user.numel(), device=device) - \
            cand_off[:-1][cand_user]

        # The STU layers on the new rows; new non-target tokens' K/V kept for the cache.
        new_k, new_v = [], []
        for number, layer in enumerate(tr.stu.layers):
            h, dqk, dv = layer.num_heads, layer.attention_dim, layer.linear_dim
            n = layer_norm_fp32(x, layer.input_norm_weight, layer.input_norm_bias)
            uvqk = torch.addmm(layer.uvqk_bias, n, layer.uvqk_weight)
            u, v, q, k = torch.split(uvqk, [dv * h, dv * h, dqk * h, dqk * h], dim=-1)
            q, k, v = q.reshape(-1, h, dqk), k.reshape(-1, h, dqk), v.reshape(-1, h, dv)
            a = paged_hstu_mha(
                q.contiguous(), k.contiguous(), v.contiguous(), q_offsets, k_pages[number], v_pages[number],
                page_table, on["seq_len"], on["cand_len"], cfg.attn_scaling_seqlen, cfg.attn_alpha, c,
                cfg.max_attn_len, max_seq_len=max_seq_len, max_query_len=max_query_len,
            ).reshape(-1, h * dv)  # fmt: skip
            gated = stu_gate(u, a, layer.output_norm_weight, layer.output_norm_bias, LAYER_NORM_EPS)
            x = x + gated @ layer.output_weight
            new_k.append(k[kept])
            new_v.append(v[kept])

        candidates = x[cand_rows]
        if cfg.postprocessor == "l2norm":
            candidates = F.normalize(candidates, p=2.0, dim=-1, eps=1e-6)
        else:
            candidates = layer_norm_fp32(candidates, tr.post_norm_weight, tr.post_norm_bias)
        return DeltaOutputs(self.model.task_heads(candidates), torch.stack(new_k), torch.stack(new_v), kept_user,
                            index[kept])
