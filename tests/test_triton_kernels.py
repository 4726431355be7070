"""The Triton kernels of hstu_export.ops._triton against a float64 dense reference.

The kernels run under Triton's CPU interpreter (TRITON_INTERPRET=1). Triton reads that variable
when it is first imported, so the checks run in a subprocess (this file run as a script): the
setting never leaks into other test modules. The subprocess also turns on PyTorch's
``fill_uninitialized_memory``, so every ``torch.empty`` output starts as NaN and an element a kernel
fails to write shows up as an error.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------------------------------------
# Reference (float64, one sequence at a time, mask written straight from DESIGN.md)
# ---------------------------------------------------------------------------------------------


def valid_mask(n: int, t: int | None, c: int, max_attn_len: int, causal: bool) -> torch.Tensor:
    if not causal:
        return torch.ones(n, n, dtype=torch.bool)
    x = torch.arange(n)
    p = torch.clamp(x - c + 1, min=0) if c > 0 else x
    m = n - (t or 0) - (c - 1 if c > 0 else 0)
    if t is not None:
        p = torch.clamp(p, max=m)
    dist = p[:, None] - p[None, :]
    valid = torch.eye(n, dtype=torch.bool) | (dist > 0)
    if max_attn_len > 0:
        valid &= dist <= max_attn_len
    if c > 0:
        valid |= (p[:, None] == 0) & (p[None, :] < m)
    return valid


def reference_mha(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    scaling_seqlen: int,
    alpha: float,
    causal: bool,
    num_targets: torch.Tensor | None,
    contextual_seq_len: int,
    max_attn_len: int,
) -> torch.Tensor:
    q, k, v = q.double(), k.double(), v.double()
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=torch.float64)
    for b in range(offsets.numel() - 1):
        s, e = int(offsets[b]), int(offsets[b + 1])
        t = None if num_targets is None else int(num_targets[b])
        mask = valid_mask(e - s, t, contextual_seq_len, max_attn_len, causal)
        scores = torch.einsum("ihd,jhd->hij", q[s:e], k[s:e]) * alpha
        scores = torch.nn.functional.silu(scores) / scaling_seqlen * mask
        out[s:e] = torch.einsum("hij,jhd->ihd", scores, v[s:e])
    return out


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out = out.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


# ---------------------------------------------------------------------------------------------
# Cases (plain data: the pytest process enumerates them without importing the kernels)
# ---------------------------------------------------------------------------------------------

LENGTHS = [1, 17, 40, 33, 5, 0, 24]
ATTENTION_CASES: dict[str, dict[str, Any]] = {
    "causal_fp32": dict(dqk=16, dv=16),
    "causal_dqk24_dv40_fp32": dict(dqk=24, dv=40),
    "targets_fp32": dict(dqk=16, dv=16, targets=True),
    "all_targets_fp32": dict(dqk=16, dv=16, targets="all"),
    "context_fp32": dict(dqk=16, dv=32, context=3),
    "context1_targets_fp32": dict(dqk=16, dv=16, targets=True, context=1),
    "targets_context_fp32": dict(dqk=24, dv=16, targets=True, context=4),
    "window_fp32": dict(dqk=16, dv=16, window=5),
    "window_targets_fp32": dict(dqk=16, dv=24, targets=True, window=7),
    "window_targets_context_d40_fp32": dict(dqk=40, dv=24, targets=True, context=3, window=6),
    "window_long_targets_context_fp32": dict(dqk=16, dv=16, targets=True, context=2, window=30),
    "noncausal_fp32": dict(dqk=24, dv=16, causal=False),
    "noncausal_targets_fp32": dict(dqk=16, dv=16, causal=False, targets=True),
    "no_skipping_all_features_fp32": dict(dqk=24, dv=40, targets=True, context=3, window=6, skip=False),
    "no_skipping_noncausal_fp32": dict(dqk=16, dv=16, causal=False, skip=False),
    "grid_shorter_than_sequences_fp32": dict(dqk=16, dv=16, targets=True, context=2, max_seq_len=16),
    "strided_qkv_fp32": dict(dqk=16, dv=24, targets=True, strided=True),
    "causal_bf16": dict(dqk=32, dv=32, dtype="bf16"),
    "all_features_d24_d40_bf16": dict(dqk=24, dv=40, targets=True, context=3, window=6, dtype="bf16"),
    "cached_fp32": dict(dqk=16, dv=16, delta=4),
    "cached_all_features_fp32": dict(dqk=24, dv=40, delta=5, targets=True, context=2, window=6),
    "cached_no_targets_window_fp32": dict(dqk=16, dv=16, delta=3, window=4),
    "cached_bf16": dict(dqk=32, dv=24, delta=4, targets=True, context=2, dtype="bf16"),
}
# hstu_mha_gated: attention written into the middle third of the concat, then the gate kernel.
GATED_CASES: dict[str, dict[str, Any]] = {
    "gated_targets_context_fp32": dict(dqk=16, dv=16, targets=True, context=2),
    "gated_dqk24_dv40_window_fp32": dict(dqk=24, dv=40, window=6),
    "gated_bf16": dict(dqk=32, dv=32, targets=True, dtype="bf16"),
}
JAGGED_CASES: dict[str, dict[str, Any]] = {
    "jagged_to_padded_fp32": dict(op="to_padded", d=24, max_len=48),
    "jagged_to_padded_truncate_bf16": dict(op="to_padded", d=40, max_len=20, dtype="bf16"),
    "jagged_to_padded_1d_int64": dict(op="to_padded", d=(), max_len=30, dtype="int64"),
    "jagged_to_padded_3d_fp32": dict(op="to_padded", d=(3, 5), max_len=41),
    "dense_to_jagged_3d_bf16": dict(op="to_jagged", d=(2, 12), total_len=True, dtype="bf16"),
    "dense_to_jagged_fp32": dict(op="to_jagged", d=40, total_len=True),
    "dense_to_jagged_no_total_len_fp32": dict(op="to_jagged", d=16, total_len=False),
    "dense_to_jagged_longer_than_n_fp32": dict(op="to_jagged", d=24, total_len=True, n=20),
    "concat_2d_jagged_fp32": dict(op="concat", d=40),
    "concat_2d_jagged_bf16": dict(op="concat", d=16, dtype="bf16"),
    "concat_2d_jagged_1d_int64": dict(op="concat", d=(), dtype="int64"),
    "split_2d_jagged_fp32": dict(op="split", d=24),
    "split_2d_jagged_one_sequence_fp32": dict(op="split", d=24, batch=1),
    "split_2d_jagged_3d_bf16": dict(op="split", d=(4, 6), dtype="bf16"),
    # Inductor runs user kernels on all-zero int inputs while compiling: no access out of range.
    "all_zero_offsets_memory_safe": dict(op="zero_offsets", d=64),
}
TOLERANCE = {"fp32": 1e-5, "bf16": 1e-2}


def _dtype(name: str) -> torch.dtype:
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "int64": torch.int64}[name]


def _random(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    if dtype == torch.int64:  # ids beyond 2**53: exact copies only
        return torch.randint(-(2**62), 2**62, shape, generator=gen, dtype=torch.int64)
    return torch.randn(shape, generator=gen).to(dtype)


def _exact_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    # Jagged ops copy values: any difference (or a shape/dtype change) is an error.
    return 0.0 if out.dtype == ref.dtype and out.shape == ref.shape and torch.equal(out, ref) else 1.0


def _offsets(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)


def run_attention_case(spec: dict[str, Any], seed: int) -> dict[str, float]:
    from hstu_export.ops._triton import cached_hstu_mha_triton_fwd  # noqa: F401  (registers the ops)

    gen = torch.Generator().manual_seed(seed)
    dtype = _dtype(spec.get("dtype", "fp32"))
    dqk, dv, H = spec["dqk"], spec["dv"], 2
    causal = spec.get("causal", True)
    context, window, delta = spec.get("context", 0), spec.get("window", 0), spec.get("delta", 0)
    lengths = [max(n, delta) for n in LENGTHS] if delta else LENGTHS
    offsets = _offsets(lengths)
    L = int(offsets[-1])
    if spec.get("strided"):
        fused = torch.randn(L, H * (2 * dqk + dv) + 3, generator=gen).to(dtype)
        q = fused[:, : H * dqk].view(L, H, dqk)
        k = fused[:, H * dqk : 2 * H * dqk].view(L, H, dqk)
        v = fused[:, 2 * H * dqk : 2 * H * dqk + H * dv].view(L, H, dv)
    else:
        q = torch.randn(L, H, dqk, generator=gen).to(dtype)
        k = torch.randn(L, H, dqk, generator=gen).to(dtype)
        v = torch.randn(L, H, dv, generator=gen).to(dtype)
    num_targets = None
    if spec.get("targets") == "all":
        num_targets = torch.tensor(lengths, dtype=torch.int64)
    elif spec.get("targets"):
        # Between 0 and n - context targets, some at the bounds.
        room = [max(n - context, 0) for n in lengths]
        num_targets = torch.tensor(
            [[r, 0, min(r, 3)][i % 3] if i % 2 else int(torch.randint(0, r + 1, (1,), generator=gen)) for i, r in enumerate(room)],
            dtype=torch.int64,
        )  # fmt: skip
    max_seq_len = spec.get("max_seq_len", max(lengths) + 3)
    scaling_seqlen, alpha = 37, 0.7 / dqk**0.5
    ref = reference_mha(q, k, v, offsets, scaling_seqlen, alpha, causal, num_targets, context, window)
    if delta:
        rows = torch.cat(
            [torch.arange(int(offsets[b + 1]) - delta, int(offsets[b + 1])) for b in range(len(lengths))]
        )
        out = torch.ops.hstu_export.cached_hstu_mha_triton(
            q[rows].contiguous(),
            k,
            v,
            offsets,
            delta,
            max_seq_len,
            scaling_seqlen,
            alpha,
            num_targets,
            context,
            window,
        )
        ref = ref[rows]
    elif spec.get("skip", True):
        out = torch.ops.hstu_export.hstu_mha_triton(
            q, k, v, offsets, max_seq_len, scaling_seqlen, alpha, causal, num_targets, context, window
        )
    else:
        from hstu_export.ops._triton import hstu_mha_triton_fwd

        out = hstu_mha_triton_fwd(
            q, k, v, offsets, max_seq_len, scaling_seqlen, alpha, causal, num_targets, context, window,
            block_skipping=False,
        )  # fmt: skip
    assert out.dtype == dtype and out.shape == ref.shape, (out.dtype, out.shape, ref.shape)
    return {"rel_err": rel_err(out, ref)}


def run_gated_case(spec: dict[str, Any], seed: int) -> dict[str, float]:
    from hstu_export.ops._triton import hstu_mha_gated_triton_fwd  # noqa: F401  (registers the ops)
    from hstu_export.ops.reference import hstu_mha_gated_reference

    gen = torch.Generator().manual_seed(seed)
    dtype = _dtype(spec.get("dtype", "fp32"))
    dqk, dv, H = spec["dqk"], spec["dv"], 2
    context, window = spec.get("context", 0), spec.get("window", 0)
    offsets = _offsets(LENGTHS)
    L, width = int(offsets[-1]), H * dv
    uvqk = torch.randn(L, 2 * width + 2 * H * dqk, generator=gen).to(dtype)
    weight = (1 + 0.3 * torch.randn(width, generator=gen)).to(dtype)
    bias = (0.2 * torch.randn(width, generator=gen)).to(dtype)
    num_targets = None
    if spec.get("targets"):
        num_targets = torch.tensor([min(max(n - context, 0), (3 * n) // 4) for n in LENGTHS], dtype=torch.int64)
    max_seq_len, scaling_seqlen, alpha, eps = max(LENGTHS) + 3, 37, 0.7 / dqk**0.5, 1e-6
    args = (uvqk, offsets, weight, bias, H, dqk, dv, max_seq_len, scaling_seqlen, alpha, True, num_targets,
            context, window, eps)  # fmt: skip
    out = torch.ops.hstu_export.hstu_mha_gated_triton(*args)
    # float64 reference of every piece; the op's own reference (same dtype) as a second check.
    u, v, q, k = torch.split(uvqk.double(), [width, width, H * dqk, H * dqk], dim=-1)
    a = reference_mha(
        q.reshape(L, H, dqk), k.reshape(L, H, dqk), v.reshape(L, H, dv), offsets, scaling_seqlen, alpha, True,
        num_targets, context, window,
    ).reshape(L, width)  # fmt: skip
    silu_u = torch.nn.functional.silu(u)
    normed = torch.nn.functional.layer_norm(a, (width,), weight.double(), bias.double(), eps)
    ref = torch.cat([silu_u, a, silu_u * normed], dim=-1)
    same_dtype = hstu_mha_gated_reference(*args)
    assert out.dtype == dtype and out.shape == ref.shape, (out.dtype, out.shape, ref.shape)
    return {"rel_err": max(rel_err(out, ref), rel_err(out, same_dtype.double())),
            "vs_fp64": rel_err(out, ref), "vs_op_reference": rel_err(out, same_dtype.double())}


def run_jagged_case(spec: dict[str, Any], seed: int) -> dict[str, float]:
    import hstu_export.ops._triton  # noqa: F401  (registers the ops)

    gen = torch.Generator().manual_seed(seed)
    dtype = _dtype(spec.get("dtype", "fp32"))
    rest = (spec["d"],) if isinstance(spec["d"], int) else tuple(spec["d"])
    lengths = LENGTHS[: spec.get("batch", len(LENGTHS))]
    offsets = _offsets(lengths)
    B, L = len(lengths), int(offsets[-1])
    errs: list[float] = []
    if spec["op"] == "zero_offsets":
        zeros = torch.zeros(B + 1, dtype=torch.int64)
        big, tiny = _random((4000, *rest), dtype, gen), _random((2, *rest), dtype, gen)
        padded = torch.ops.hstu_export.jagged_to_padded_dense_triton(tiny, zeros, 64, -1.0)
        errs.append(_exact_err(padded, torch.full((B, 64, *rest), -1.0, dtype=dtype)))
        torch.ops.hstu_export.dense_to_jagged_triton(torch.ones(B, 64, *rest, dtype=dtype), zeros, 2)
        joined = torch.ops.hstu_export.concat_2D_jagged_triton(big, zeros, tiny, zeros)
        torch.ops.hstu_export.split_2D_jagged_triton(joined, zeros, zeros, 2, 2)
    elif spec["op"] == "to_padded":
        values = _random((L, *rest), dtype, gen)
        max_len, pad = spec["max_len"], -3.0
        ref = torch.full((B, max_len, *rest), pad).to(dtype)
        for b, n in enumerate(lengths):
            m = min(n, max_len)
            ref[b, :m] = values[int(offsets[b]) : int(offsets[b]) + m]
        errs.append(
            _exact_err(torch.ops.hstu_export.jagged_to_padded_dense_triton(values, offsets, max_len, pad), ref)
        )
    elif spec["op"] == "to_jagged":
        n_pad = spec.get("n", max(lengths))
        dense = _random((B, n_pad, *rest), dtype, gen)
        ref = torch.zeros(L, *rest, dtype=dtype)
        for b, n in enumerate(lengths):
            m = min(n, n_pad)
            ref[int(offsets[b]) : int(offsets[b]) + m] = dense[b, :m]
        out = torch.ops.hstu_export.dense_to_jagged_triton(dense, offsets, L if spec["total_len"] else None)
        errs.append(_exact_err(out, ref))
    else:
        right_lengths = [(3 * n + 1) % 7 for n in lengths]
        offsets_r = _offsets(right_lengths)
        left = _random((L, *rest), dtype, gen)
        right = _random((int(offsets_r[-1]), *rest), dtype, gen)
        joined = torch.cat(
            [
                torch.cat(
                    [
                        left[int(offsets[b]) : int(offsets[b + 1])],
                        right[int(offsets_r[b]) : int(offsets_r[b + 1])],
                    ]
                )
                for b in range(B)
            ]
        )
        if spec["op"] == "concat":
            out = torch.ops.hstu_export.concat_2D_jagged_triton(left, offsets, right, offsets_r)
            errs.append(_exact_err(out, joined))
        else:
            out_l, out_r = torch.ops.hstu_export.split_2D_jagged_triton(
                joined, offsets, offsets_r, left.shape[0], right.shape[0]
            )
            errs += [_exact_err(out_l, left), _exact_err(out_r, right)]
    return {"rel_err": max(errs)}


def run_cases(names: list[str]) -> dict[str, dict[str, float]]:
    results = {}
    for i, name in enumerate(names):
        if name in ATTENTION_CASES:
            results[name] = run_attention_case(ATTENTION_CASES[name], seed=i)
        elif name in GATED_CASES:
            results[name] = run_gated_case(GATED_CASES[name], seed=i)
        else:
            results[name] = run_jagged_case(JAGGED_CASES[name], seed=i)
    return results


# ---------------------------------------------------------------------------------------------
# pytest side
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def interpreted_results() -> dict[str, dict[str, float]]:
    env = dict(
        os.environ,
        TRITON_INTERPRET="1",
        PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
    )
    proc = subprocess.run(
        [sys.executable, __file__, *ATTENTION_CASES, *GATED_CASES, *JAGGED_CASES],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", list(ATTENTION_CASES))
def test_attention_matches_reference(interpreted_results: dict[str, dict[str, float]], name: str) -> None:
    tol = TOLERANCE[ATTENTION_CASES[name].get("dtype", "fp32")]
    assert interpreted_results[name]["rel_err"] < tol


@pytest.mark.parametrize("name", list(GATED_CASES))
def test_gated_attention_matches_reference(interpreted_results: dict[str, dict[str, float]], name: str) -> None:
    tol = TOLERANCE[GATED_CASES[name].get("dtype", "fp32")]
    assert interpreted_results[name]["rel_err"] < tol


@pytest.mark.parametrize("name", list(JAGGED_CASES))
def test_jagged_ops_match_reference(interpreted_results: dict[str, dict[str, float]], name: str) -> None:
    # Pure copies: exact, padding included.
    assert interpreted_results[name]["rel_err"] == 0.0


def test_reference_mask_semantics() -> None:
    # DESIGN.md consequences: a target sees the history and itself, never another target; context
    # tokens see context and history; with a window, the diagonal stays valid.
    n, t, c = 10, 3, 2
    mask = valid_mask(n, t, c, 0, True)
    hist_end = n - t
    for i in range(hist_end, n):
        assert mask[i, :hist_end].all() and mask[i, i]
        assert mask[i, hist_end:].sum() == 1
    assert mask[:c, :hist_end].all() and not mask[:c, hist_end:].any()
    windowed = valid_mask(n, None, 0, 2, True)
    assert windowed.diagonal().all() and windowed[5, 3] and not windowed[5, 2]


def test_registered_schemas() -> None:
    import hstu_export.ops._triton as triton_ops

    schemas = {
        name: str(getattr(torch.ops.hstu_export, name.split("::")[1]).default._schema)
        for name in triton_ops.OP_NAMES
    }
    assert schemas["hstu_export::hstu_mha_triton"].startswith(
        "hstu_export::hstu_mha_triton(Tensor q, Tensor k, Tensor v, Tensor seq_offsets, SymInt max_seq_len, "
        "SymInt scaling_seqlen, float alpha, bool causal, Tensor? num_targets, SymInt contextual_seq_len, "
        "SymInt max_attn_len) -> Tensor"
    )
    assert (
        "(Tensor values, Tensor offsets_left, Tensor offsets_right, SymInt total_len_left, SymInt total_len_right)"
        in (schemas["hstu_export::split_2D_jagged_triton"])
    )
    # Importing again registers nothing twice.
    import importlib

    importlib.import_module("hstu_export.ops._triton")


def test_config_table_is_deterministic() -> None:
    from hstu_export.ops._triton import attention_config, chosen_configs

    h100 = attention_config((9, 0), 128, 128, torch.bfloat16)
    assert h100 == attention_config((9, 0), 128, 128, torch.bfloat16)
    assert attention_config((9, 0), 100, 120, torch.bfloat16) == h100  # both pad to 128
    assert attention_config((9, 0), 256, 40, torch.float16).block_m <= h100.block_m
    for capability in [(8, 0), (8, 9), (9, 0), (10, 0), None]:
        for dqk, dv in [(16, 16), (24, 40), (128, 128), (256, 256), (200, 64)]:
            for dtype in (torch.float32, torch.bfloat16):
                cfg = attention_config(capability, dqk, dv, dtype)
                assert cfg.block_m >= 16 and cfg.block_n >= 16 and cfg.num_warps >= 1
    with pytest.raises(ValueError):
        attention_config((9, 0), 512, 128, torch.bfloat16)
    chosen = chosen_configs()
    assert chosen["attention/sm_90/16bit/dqk128_dv128"]["block_m"] == h100.block_m
    json.dumps(chosen)


def test_collecting_configs_sees_only_lookups_inside_the_block() -> None:
    from hstu_export.ops._triton import attention_config, gate_config
    from hstu_export.ops._triton.configs import collecting_configs

    attention_config((9, 0), 64, 64, torch.bfloat16)  # before: cached from now on
    with collecting_configs() as used:
        attention_config((9, 0), 64, 64, torch.bfloat16)  # a cached lookup still counts
        gate_config((9, 0), 512)
    attention_config((8, 0), 32, 32, torch.float32)  # after: not collected
    assert set(used) == {"attention/sm_90/16bit/dqk64_dv64", "gate/gpu/width512"}
    assert used["gate/gpu/width512"]["block_d"] == 512 and used["gate/gpu/width512"]["block_rows"] == 8


def test_export_keeps_the_op() -> None:
    import hstu_export.ops._triton  # noqa: F401

    class Attention(torch.nn.Module):
        def forward(self, q, k, v, offsets, num_targets):
            return torch.ops.hstu_export.hstu_mha_triton(q, k, v, offsets, 64, 64, 0.25, True, num_targets, 0, 0)

    L, H, D = 20, 2, 16
    args = (
        torch.randn(L, H, D),
        torch.randn(L, H, D),
        torch.randn(L, H, D),
        _offsets([8, 12]),
        torch.tensor([2, 3]),
    )
    ep = torch.export.export(Attention(), args)
    targets = {str(node.target) for node in ep.graph.nodes if node.op == "call_function"}
    assert "hstu_export.hstu_mha_triton.default" in targets


def test_export_takes_an_attention_scale_read_from_the_data() -> None:
    """generative-recommenders scales attention by the batch's longest sequence, read with ``.item()``: the op
    takes that unbacked size as it is (the kernel divides by it; no host float of a symbol)."""
    import hstu_export.ops._triton  # noqa: F401

    class Attention(torch.nn.Module):
        def forward(self, q, k, v, offsets, num_targets):
            longest = (offsets[1:] - offsets[:-1]).max().item()
            torch._check(longest >= 1)
            return torch.ops.hstu_export.hstu_mha_triton(q, k, v, offsets, 64, longest, 0.25, True, num_targets, 0, 0)

    L, H, D = 20, 2, 16
    args = (torch.randn(L, H, D), torch.randn(L, H, D), torch.randn(L, H, D), _offsets([8, 12]), torch.tensor([2, 3]))
    ep = torch.export.export(Attention(), args)
    attention = next(n for n in ep.graph.nodes if str(n.target) == "hstu_export.hstu_mha_triton.default")
    assert isinstance(attention.args[5], torch.fx.Node)  # the scale stays a value of the graph, not a constant


def test_padding_to_a_length_read_from_the_data_needs_no_guard(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model padding its rows to its own ``lengths.max().item()`` (tests/user_models/dlrm_hstu.py does): when
    AOTInductor compiles the op, that length is an unbacked symbol, and the launch grid is computed without a
    guard on it (a Python ``max`` would ask whether it is below one and fail the compile)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from hstu_export.ops._triton import jagged

    grids = []
    monkeypatch.setattr(jagged, "wrap_triton", lambda kernel: _Launcher(grids))
    env, real = ShapeEnv(), (torch.randn(20, 8), _offsets([8, 12]))
    with FakeTensorMode(shape_env=env) as mode:
        values, offsets = (mode.from_tensor(t) for t in real)
        longest = env.create_unbacked_symint()
        out = jagged.jagged_to_padded_dense_triton._init_fn(values, offsets, longest, 0.0)
    assert tuple(out.shape) == (2, longest, 8)
    assert isinstance(grids[0][0], torch.SymInt) and grids[0][1:] == (2, 1)


class _Launcher:
    """Stands in for ``wrap_triton(kernel)``: records each launch's grid."""

    def __init__(self, grids: list) -> None:
        self.grids = grids

    def __getitem__(self, grid: tuple) -> Any:
        self.grids.append(grid)
        return lambda *args, **kwargs: None


if __name__ == "__main__":
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True  # torch.empty -> NaN
    print(json.dumps(run_cases(sys.argv[1:])))


@pytest.mark.parametrize("kernel", ["attention", "paged", "paged --targets-only"])
def test_kernels_compile_for_hopper_without_spilling(kernel: str) -> None:
    """benchmarks/investigations/kernel_report.py compiles a kernel for sm_90 without a GPU (Triton ships
    ptxas): the table's Hopper config of each attention kernel (the full one, the KV cache's paged one, and the
    paged one as the delta program's last layer launches it) must use wgmma, load through the cp.async pipeline
    and spill at most a few registers (the H100 timings assume it)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = REPO_ROOT / "benchmarks" / "investigations" / "kernel_report.py"
    done = subprocess.run([sys.executable, str(script), "--kernel", *kernel.split(), "--configs", "64x64x4x3"],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["HGMMA"] > 0 and report["LDGSTS"] > 0, report
    assert report["stack"] <= 64 and report["regs"] <= 255, report


@pytest.mark.parametrize(("precision", "dtype", "expected"), [
    ("highest", torch.float32, "ieee"), ("high", torch.float32, "tf32"), ("highest", torch.bfloat16, "tf32")])
def test_fp32_products_follow_torchs_matmul_precision(monkeypatch: pytest.MonkeyPatch, precision: str,
                                                      dtype: torch.dtype, expected: str) -> None:
    """Both attention kernels multiply fp32 operands as torch multiplies fp32 matrices: in full fp32 at torch's
    default precision, in TF32 only where the process allows it (``torch.set_float32_matmul_precision("high")``);
    16-bit operands as before. An fp32 export on CUDA is then held to fp32's tolerances unless TF32 is allowed
    (with TF32 products, the TorchEasyRec-style model at DLRMv3's dims was 2.4e-3 from its own forward on an
    H200)."""
    import hstu_export.ops._triton.attention as attention
    import hstu_export.ops._triton.paged as paged
    from hstu_export.ops._triton.configs import AttentionConfig
    from hstu_export.settings import ExportSettings

    launched: dict[str, str] = {}

    class Recorder:
        def __init__(self, name: str) -> None:
            self.name = name

        def __getitem__(self, grid: Any) -> Any:
            def launch(*args: Any, **kwargs: Any) -> None:
                launched[self.name] = kwargs.get("DOT_PRECISION", "none")
            return launch

    monkeypatch.setattr(attention, "_hstu_attn_fwd", Recorder("attention"))
    monkeypatch.setattr(paged, "_paged_attn_fwd", Recorder("paged"))
    monkeypatch.setattr(paged, "_sum_slices", Recorder("sum"))
    was = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        q = torch.zeros(6, 2, 16, dtype=dtype)
        attention.hstu_mha_triton_fwd(q, q, q, torch.tensor([0, 6]), 6, 6, 0.5, True, None, 0, 0,
                                      config=AttentionConfig(16, 16, 4, 1))
        pages = torch.zeros(2, 16, 2, 16, dtype=dtype)
        paged.paged_hstu_mha_triton_fwd(q, q, q, torch.tensor([0, 6]), pages, pages.clone(),
                                        torch.zeros(1, 1, dtype=torch.int32), torch.tensor([6]), torch.tensor([0]),
                                        6, 0.5, max_seq_len=6, max_query_len=6, config=AttentionConfig(16, 16, 4, 1))
        tolerances = ExportSettings(dtype="float32", device="cuda").tolerances()
        from_cpu = ExportSettings(dtype="float32", device="cuda", reference_device="cpu").tolerances()
    finally:
        torch.set_float32_matmul_precision(was)
    assert launched["attention"] == launched["paged"] == expected, launched
    tf32 = {"rel_l2": 2e-4, "max_abs": 5e-4}
    assert tolerances == (tf32 if precision == "high" else {"rel_l2": 1e-5, "max_abs": 1e-4})
    # Against a reference on the CPU, fp32 allows for the two devices' orders of summation.
    assert from_cpu == (tf32 if precision == "high" else {"rel_l2": 1e-4, "max_abs": 1e-4})
