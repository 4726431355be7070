"""STU layer and stack (DESIGN.md, "STU layer")."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hstu_export.models.config import HSTUConfig
from hstu_export.ops import Kernel, hstu_mha_gated

LAYER_NORM_EPS = 1e-6


def layer_norm_fp32(x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """LayerNorm computed in fp32 whatever the input dtype, cast back to it."""
    out = F.layer_norm(x.float(), (x.shape[-1],), weight.float(), bias.float(), LAYER_NORM_EPS)
    return out.to(x.dtype)


class STULayer(nn.Module):
    """One STU layer on jagged values ``x[L, D]``.

    n = LN(x); u, v, q, k = split(n @ W_uvqk + b); u = SiLU(u); a = hstu_mha(q, k, v);
    out = x + concat(u, a, u * LN(a)) @ W_out.
    """

    def __init__(self, config: HSTUConfig) -> None:
        super().__init__()
        self.config = config
        d, h = config.embedding_dim, config.num_heads
        self.num_heads = h
        self.attention_dim = config.attention_dim
        self.linear_dim = config.linear_dim
        self.kernel = Kernel(config.kernel)
        uvqk_dim = (2 * config.linear_dim + 2 * config.attention_dim) * h
        self.input_norm_weight = nn.Parameter(torch.ones(d))
        self.input_norm_bias = nn.Parameter(torch.zeros(d))
        self.uvqk_weight = nn.Parameter(torch.empty(d, uvqk_dim))
        self.uvqk_bias = nn.Parameter(torch.zeros(uvqk_dim))
        self.output_norm_weight = nn.Parameter(torch.ones(config.linear_dim * h))
        self.output_norm_bias = nn.Parameter(torch.zeros(config.linear_dim * h))
        self.output_weight = nn.Parameter(torch.empty(3 * config.linear_dim * h, d))
        nn.init.xavier_uniform_(self.uvqk_weight)
        nn.init.xavier_uniform_(self.output_weight)

    def forward(self, x: Tensor, seq_offsets: Tensor, num_targets: Tensor | None) -> Tensor:
        cfg = self.config
        h, dqk, dv = self.num_heads, self.attention_dim, self.linear_dim
        n = layer_norm_fp32(x, self.input_norm_weight, self.input_norm_bias)
        uvqk = torch.addmm(self.uvqk_bias, n, self.uvqk_weight)
        # concat(SiLU(u), a, SiLU(u) * LN(a)) with a = hstu_mha(q, k, v): one op between the projections.
        gated = hstu_mha_gated(
            uvqk,
            seq_offsets,
            self.output_norm_weight,
            self.output_norm_bias,
            num_heads=h,
            attention_dim=dqk,
            linear_dim=dv,
            max_seq_len=cfg.max_seq_len,
            scaling_seqlen=cfg.attn_scaling_seqlen,
            alpha=cfg.attn_alpha,
            causal=True,
            num_targets=num_targets,
            contextual_seq_len=cfg.contextual_seq_len,
            max_attn_len=cfg.max_attn_len,
            eps=LAYER_NORM_EPS,
            kernel=self.kernel,
        )
        return x + gated @ self.output_weight


class STUStack(nn.Module):
    def __init__(self, config: HSTUConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList([STULayer(config) for _ in range(config.num_layers)])

    def forward(self, x: Tensor, seq_offsets: Tensor, num_targets: Tensor | None) -> Tensor:
        for layer in self.layers:
            x = layer(x, seq_offsets, num_targets)
        return x
