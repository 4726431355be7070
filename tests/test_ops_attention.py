"""HSTU attention ops against a slow per-sequence loop written straight from DESIGN.md."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.export import Dim

from hstu_export.errors import ConfigError
from hstu_export.ops import Kernel, cached_hstu_mha, hstu_mha, hstu_mha_gated, lengths_to_offsets
from hstu_export.ops.reference import cached_hstu_mha_reference, hstu_mha_reference

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


# ---- the slow, obviously-correct definition ----------------------------------------------------


def loop_positions(n: int, t: int | None, c: int) -> list[int]:
    """p(x) for x in 0..n-1; t=None means no num_targets tensor was given."""
    m = n - (t or 0) - (c - 1 if c > 0 else 0)
    out = []
    for x in range(n):
        p = x
        if c > 0:
            p = max(x - c + 1, 0)
        if t is not None:
            p = min(p, m)
        out.append(p)
    return out


def loop_valid(i: int, j: int, n: int, t: int | None, c: int, w: int, causal: bool) -> bool:
    if not causal:
        return True
    p = loop_positions(n, t, c)
    m = n - (t or 0) - (c - 1 if c > 0 else 0)
    d = p[i] - p[j]
    ok = i == j or (d > 0 and (w == 0 or d <= w))
    if c > 0 and p[i] == 0 and p[j] < m:
        ok = True
    return ok


def loop_hstu_mha(q, k, v, lengths, *, scaling_seqlen, alpha, causal=True, num_targets=None, c=0, w=0):
    """out_i = sum_j SiLU(alpha <q_i, k_j>) / S * valid(i, j) * v_j, per sequence, in float64."""
    q, k, v = q.double(), k.double(), v.double()
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=torch.float64)
    start = 0
    for b, n in enumerate(lengths):
        t = None if num_targets is None else int(num_targets[b])
        for i in range(n):
            for j in range(n):
                if loop_valid(i, j, n, t, c, w, causal):
                    s = (q[start + i] * k[start + j]).sum(-1)  # [H]
                    score = s * alpha * torch.sigmoid(s * alpha) / scaling_seqlen
                    out[start + i] += score[:, None] * v[start + j]
        start += n
    return out


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double().cpu() - expected).abs().max() / expected.abs().max().clamp(min=1e-12)).item()


def make_inputs(lengths, heads=2, dqk=8, dv=6, dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q, k = (torch.randn(total, heads, dqk, generator=gen) for _ in range(2))
    v = torch.randn(total, heads, dv, generator=gen)
    offsets = lengths_to_offsets(torch.tensor(lengths, dtype=torch.int64))
    return [x.to(device=device, dtype=dtype) for x in (q, k, v)] + [offsets.to(device)]


# ---- hstu_mha vs the loop ----------------------------------------------------------------------

CASES = {
    "plain": dict(lengths=[5, 1, 12, 7], targets=None, c=0, w=0),
    "targets": dict(lengths=[5, 1, 12, 7], targets=[2, 0, 11, 6], c=0, w=0),
    "contextual": dict(lengths=[6, 3, 12, 9], targets=None, c=3, w=0),
    "contextual_targets": dict(lengths=[6, 4, 12, 9], targets=[1, 0, 4, 6], c=3, w=0),
    "window": dict(lengths=[5, 1, 12, 7], targets=None, c=0, w=3),
    "all_rules": dict(lengths=[7, 5, 12, 10], targets=[2, 0, 3, 7], c=2, w=3),
    "empty_and_single": dict(lengths=[0, 1, 9, 0], targets=[0, 0, 4, 0], c=0, w=2),
    "batch1": dict(lengths=[11], targets=[3], c=2, w=0),
}


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("name", list(CASES))
def test_hstu_mha_matches_loop_fp32(name, causal):
    case = CASES[name]
    q, k, v, offsets = make_inputs(case["lengths"], dqk=8, dv=6)
    targets = None if case["targets"] is None else torch.tensor(case["targets"])
    scaling, alpha = 16, 1 / math.sqrt(8)
    out = hstu_mha(
        q, k, v, offsets, max_seq_len=16, scaling_seqlen=scaling, alpha=alpha, causal=causal,
        num_targets=targets, contextual_seq_len=case["c"], max_attn_len=case["w"],
    )  # fmt: skip
    expected = loop_hstu_mha(
        q, k, v, case["lengths"], scaling_seqlen=scaling, alpha=alpha, causal=causal,
        num_targets=targets, c=case["c"], w=case["w"],
    )  # fmt: skip
    assert out.shape == (q.shape[0], 2, 6) and out.dtype == torch.float32
    assert rel_err(out, expected) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("device", DEVICES)
def test_hstu_mha_half_precision_matches_fp64_loop(dtype, device):
    case = CASES["all_rules"]
    q, k, v, offsets = make_inputs(case["lengths"], dtype=dtype, device=device)
    targets = torch.tensor(case["targets"], device=device)
    out = hstu_mha(
        q, k, v, offsets, max_seq_len=16, scaling_seqlen=16, alpha=0.35, num_targets=targets,
        contextual_seq_len=case["c"], max_attn_len=case["w"],
    )  # fmt: skip
    expected = loop_hstu_mha(
        q.cpu(), k.cpu(), v.cpu(), case["lengths"], scaling_seqlen=16, alpha=0.35,
        num_targets=targets.cpu(), c=case["c"], w=case["w"],
    )  # fmt: skip
    assert out.dtype == dtype and out.device.type == device
    assert rel_err(out, expected) < 2e-2


@pytest.mark.parametrize("device", DEVICES)
def test_hstu_mha_on_device_matches_loop(device):
    case = CASES["contextual_targets"]
    q, k, v, offsets = make_inputs(case["lengths"], device=device)
    targets = torch.tensor(case["targets"], device=device)
    out = hstu_mha(
        q, k, v, offsets, max_seq_len=16, scaling_seqlen=16, alpha=0.5, num_targets=targets,
        contextual_seq_len=case["c"],
    )  # fmt: skip
    expected = loop_hstu_mha(
        q.cpu(), k.cpu(), v.cpu(), case["lengths"], scaling_seqlen=16, alpha=0.5,
        num_targets=targets.cpu(), c=case["c"],
    )  # fmt: skip
    # TF32 may be on for CUDA matmuls; CPU fp32 is held to 1e-5 above.
    assert rel_err(out, expected) < (1e-5 if device == "cpu" else 5e-3)


@st.composite
def attention_cases(draw):
    batch = draw(st.integers(1, 4))
    lengths = draw(st.lists(st.integers(0, 9), min_size=batch, max_size=batch))
    use_targets = draw(st.booleans())
    targets = [draw(st.integers(0, max(n - 1, 0))) for n in lengths] if use_targets else None
    return dict(
        lengths=lengths,
        targets=targets,
        c=draw(st.integers(0, 3)),
        w=draw(st.integers(0, 4)),
        causal=draw(st.booleans()),
        dqk=draw(st.sampled_from([2, 4])),
        dv=draw(st.sampled_from([1, 3])),
        seed=draw(st.integers(0, 2**16)),
    )


@settings(max_examples=40, deadline=None, database=None, derandomize=True)
@given(case=attention_cases())
def test_hstu_mha_matches_loop_random(case):
    q, k, v, offsets = make_inputs(case["lengths"], dqk=case["dqk"], dv=case["dv"], seed=case["seed"])
    targets = None if case["targets"] is None else torch.tensor(case["targets"], dtype=torch.int64)
    kwargs = dict(scaling_seqlen=10, alpha=0.7, causal=case["causal"], num_targets=targets)
    out = hstu_mha(
        q, k, v, offsets, max_seq_len=10, contextual_seq_len=case["c"], max_attn_len=case["w"], **kwargs
    )
    expected = loop_hstu_mha(q, k, v, case["lengths"], c=case["c"], w=case["w"], **kwargs)
    scale = max(expected.abs().max().item(), 1.0) if expected.numel() else 1.0
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=1e-5 * scale)


# ---- consequences of the mask ------------------------------------------------------------------


def _perturbed(x: torch.Tensor, row: int) -> torch.Tensor:
    x = x.clone()
    x[row] += 3.0
    return x


def _run(q, k, v, offsets, **kwargs):
    kwargs = {"max_seq_len": 16, "scaling_seqlen": 16, "alpha": 0.5, **kwargs}
    return hstu_mha(q, k, v, offsets, **kwargs)


def test_target_sees_history_and_itself_never_other_targets():
    # One sequence of 10: 7 history tokens (0..6), 3 targets (7, 8, 9).
    q, k, v, offsets = make_inputs([10])
    targets = torch.tensor([3])
    base = _run(q, k, v, offsets, num_targets=targets)
    for other in (7, 9):  # perturb target 'other'; target 8 must not notice
        for which in ("k", "v"):
            kk = _perturbed(k, other) if which == "k" else k
            vv = _perturbed(v, other) if which == "v" else v
            out = _run(q, kk, vv, offsets, num_targets=targets)
            torch.testing.assert_close(out[8], base[8], rtol=0, atol=0)
            assert (out[other] - base[other]).abs().max() > 1e-3  # the perturbed target itself changes
    for history in (0, 6):
        out = _run(q, _perturbed(k, history), v, offsets, num_targets=targets)
        assert (out[8] - base[8]).abs().max() > 1e-3
    out = _run(q, k, _perturbed(v, 8), offsets, num_targets=targets)
    assert (out[8] - base[8]).abs().max() > 1e-3  # a target sees itself
    # History rows never see targets.
    out = _run(q, _perturbed(k, 7), _perturbed(v, 7), offsets, num_targets=targets)
    torch.testing.assert_close(out[:7], base[:7], rtol=0, atol=0)


def test_context_tokens_see_context_and_history_not_targets():
    # 3 contextual tokens (0..2), history 3..7, targets 8, 9.
    q, k, v, offsets = make_inputs([10])
    kwargs = dict(num_targets=torch.tensor([2]), contextual_seq_len=3)
    base = _run(q, k, v, offsets, **kwargs)
    for seen in (1, 2, 5, 7):
        out = _run(q, k, _perturbed(v, seen), offsets, **kwargs)
        assert (out[0] - base[0]).abs().max() > 1e-3, f"context row 0 should see token {seen}"
    out = _run(q, k, _perturbed(v, 9), offsets, **kwargs)
    torch.testing.assert_close(out[:8], base[:8], rtol=0, atol=0)
    # History tokens see the context tokens (all at position 0).
    out = _run(q, k, _perturbed(v, 0), offsets, **kwargs)
    assert (out[4] - base[4]).abs().max() > 1e-3


def test_users_do_not_affect_each_other():
    # Same user alone, and between a shorter and a much longer user (who sets the padded size).
    alone = make_inputs([6], seed=1)
    others_left, others_right = make_inputs([3], seed=2), make_inputs([15], seed=3)
    batch = [torch.cat([a, b, c]) for a, b, c in zip(others_left[:3], alone[:3], others_right[:3])]
    offsets = lengths_to_offsets(torch.tensor([3, 6, 15]))
    kwargs = dict(contextual_seq_len=1, max_attn_len=4)
    out_alone = _run(*alone[:3], alone[3], num_targets=torch.tensor([2]), **kwargs)
    out_batch = _run(*batch, offsets, num_targets=torch.tensor([1, 2, 4]), **kwargs)
    torch.testing.assert_close(out_batch[3:9], out_alone, rtol=1e-6, atol=1e-7)


def test_padding_never_contributes():
    # The static padded size only adds padding: any bound >= the longest sequence gives the same
    # result, and garbage in padded slots of k/v cannot enter (they are gathered from a zero row).
    q, k, v, offsets = make_inputs([4, 1, 9])
    args = (q, k, v, offsets)
    kwargs = dict(scaling_seqlen=12, alpha=0.5, causal=True, num_targets=torch.tensor([1, 0, 3]))
    tight = hstu_mha_reference(*args, max_seq_len=9, **kwargs)
    for bound in (10, 32):
        torch.testing.assert_close(hstu_mha_reference(*args, max_seq_len=bound, **kwargs), tight)
    full = hstu_mha_reference(*args, max_seq_len=9, **{**kwargs, "causal": False})
    # Non-causal rows of the 1-token user see only that token.
    s = (q[4] * k[4]).sum(-1) * 0.5
    torch.testing.assert_close(full[4], (torch.nn.functional.silu(s) / 12)[:, None] * v[4])


def test_scaling_is_the_config_value_not_the_batch_max():
    q, k, v, offsets = make_inputs([3, 5])
    a = _run(q, k, v, offsets, scaling_seqlen=16)
    b = _run(q, k, v, offsets, scaling_seqlen=32)
    torch.testing.assert_close(a, 2 * b)


def test_reference_at_static_size_equals_tight_eager_op():
    case = CASES["all_rules"]
    q, k, v, offsets = make_inputs(case["lengths"])
    targets = torch.tensor(case["targets"])
    args = (q, k, v, offsets, 64, 20, 0.4, True, targets, case["c"], case["w"])
    eager = torch.ops.hstu_export.hstu_mha.default(*args)  # pads to the longest sequence (12)
    static = hstu_mha_reference(*args)  # pads to 64
    torch.testing.assert_close(eager, static, rtol=1e-6, atol=1e-7)


# ---- cached (delta) attention ------------------------------------------------------------------


def _last_rows(offsets: torch.Tensor, delta: int) -> torch.Tensor:
    return torch.cat([torch.arange(int(e) - delta, int(e)) for e in offsets[1:]])


@pytest.mark.parametrize("delta", [1, 3])
@pytest.mark.parametrize("name", ["contextual", "contextual_targets", "all_rules", "batch1"])
def test_cached_hstu_mha_equals_last_rows_of_full(name, delta):
    case = CASES[name]
    q, k, v, offsets = make_inputs(case["lengths"])
    targets = None if case["targets"] is None else torch.tensor(case["targets"])
    kwargs = dict(
        max_seq_len=16, scaling_seqlen=16, alpha=0.3, num_targets=targets,
        contextual_seq_len=case["c"], max_attn_len=case["w"],
    )  # fmt: skip
    rows = _last_rows(offsets, delta)
    full = hstu_mha(q, k, v, offsets, **kwargs)
    cached = cached_hstu_mha(q[rows], k, v, offsets, delta_size=delta, **kwargs)
    assert cached.shape == (len(rows), 2, 6)
    torch.testing.assert_close(cached, full[rows], rtol=1e-5, atol=1e-6)
    static = cached_hstu_mha_reference(
        q[rows], k, v, offsets, delta, 64, 16, 0.3, targets, case["c"], case["w"]
    )
    torch.testing.assert_close(static, cached, rtol=1e-6, atol=1e-7)


def test_cached_rejects_sequences_shorter_than_delta():
    q, k, v, offsets = make_inputs([4, 2])
    with pytest.raises(ConfigError, match="delta_size"):
        cached_hstu_mha(q[:6], k, v, offsets, delta_size=3, max_seq_len=8, scaling_seqlen=8, alpha=1.0)


# ---- errors, dispatch, autograd ----------------------------------------------------------------


def test_sequence_longer_than_max_seq_len_is_a_config_error():
    q, k, v, offsets = make_inputs([4, 9])
    with pytest.raises(ConfigError, match="max_seq_len"):
        hstu_mha(q, k, v, offsets, max_seq_len=8, scaling_seqlen=8, alpha=1.0)


def test_bad_kernel_and_arguments_are_config_errors():
    q, k, v, offsets = make_inputs([3])
    kwargs = dict(max_seq_len=8, scaling_seqlen=8, alpha=1.0)
    with pytest.raises(ConfigError, match="unknown kernel"):
        hstu_mha(q, k, v, offsets, kernel="cuda-magic", **kwargs)
    with pytest.raises(ConfigError, match="max_attn_len"):
        hstu_mha(q, k, v, offsets, max_attn_len=-1, **kwargs)
    with pytest.raises(ConfigError, match="scaling_seqlen"):
        hstu_mha(q, k, v, offsets, max_seq_len=8, scaling_seqlen=0, alpha=1.0)


def test_triton_kernel_request_dispatches_or_explains():
    q, k, v, offsets = make_inputs([3, 4])
    kwargs = dict(max_seq_len=8, scaling_seqlen=8, alpha=1.0, kernel=Kernel.TRITON)
    try:
        import hstu_export.ops._triton  # noqa: F401

        registered = hasattr(torch.ops.hstu_export, "hstu_mha_triton")
    except Exception:
        registered = False
    if not registered:
        with pytest.raises(ConfigError, match="TRITON"):
            hstu_mha(q, k, v, offsets, **kwargs)
    elif torch.cuda.is_available():
        out = hstu_mha(*(x.cuda() for x in (q, k, v, offsets)), **kwargs)
        ref = hstu_mha(q, k, v, offsets, max_seq_len=8, scaling_seqlen=8, alpha=1.0)
        torch.testing.assert_close(out.cpu(), ref, rtol=2e-2, atol=2e-3)
    else:
        pytest.skip("the Triton ops are registered but there is no CUDA device to run them")


def test_gradients_match_reference_autograd():
    case = CASES["all_rules"]
    q, k, v, offsets = make_inputs(case["lengths"], dqk=4, dv=3)
    targets = torch.tensor(case["targets"])
    args = (offsets, 16, 16, 0.5, True, targets, case["c"], case["w"])
    grads = []
    for fn in (torch.ops.hstu_export.hstu_mha.default, hstu_mha_reference):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = fn(*leaves, *args)
        (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
        grads.append([x.grad for x in leaves])
    for ours, ref in zip(*grads):
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)


# ---- tracing and export ------------------------------------------------------------------------


class _Attention(torch.nn.Module):
    def forward(self, q, k, v, offsets, num_targets):
        return hstu_mha(
            q, k, v, offsets, max_seq_len=16, scaling_seqlen=16, alpha=0.5, num_targets=num_targets,
            contextual_seq_len=1, max_attn_len=4,
        )  # fmt: skip


class _AttentionReference(torch.nn.Module):
    def forward(self, q, k, v, offsets, num_targets):
        return hstu_mha_reference(q, k, v, offsets, 16, 16, 0.5, True, num_targets, 1, 4)


def _batch(lengths, seed=0):
    q, k, v, offsets = make_inputs(lengths, heads=2, dqk=4, dv=3, seed=seed)
    return (q, k, v, offsets, torch.tensor([min(2, n - 1) for n in lengths]))


def _dynamic_shapes():
    total, batch = Dim("L", min=1, max=4096), Dim("B", min=1, max=256)
    return {
        "q": {0: total}, "k": {0: total}, "v": {0: total},
        "offsets": {0: batch + 1}, "num_targets": {0: batch},
    }  # fmt: skip


def _hstu_nodes(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    return [n for n in graph.nodes if n.op == "call_function" and "hstu" in str(n.target)]


def test_fx_symbolic_trace_gives_one_hstu_mha_node():
    gm = torch.fx.symbolic_trace(_Attention())
    nodes = _hstu_nodes(gm.graph)
    assert [n.target for n in nodes] == [torch.ops.hstu_export.hstu_mha.default]
    args = _batch([3, 7])
    torch.testing.assert_close(gm(*args), _Attention()(*args), rtol=0, atol=0)


def test_export_with_dynamic_batch_and_length_gives_one_node():
    ep = torch.export.export(_Attention(), _batch([3, 5, 7]), dynamic_shapes=_dynamic_shapes(), strict=False)
    nodes = _hstu_nodes(ep.graph)
    assert [n.target for n in nodes] == [torch.ops.hstu_export.hstu_mha.default]
    for lengths in ([9], [2, 12], [1, 4, 16, 3, 8]):
        args = _batch(lengths, seed=len(lengths))
        torch.testing.assert_close(ep.module()(*args), _Attention()(*args), rtol=0, atol=0)


def test_reference_exports_to_plain_aten_for_any_batch_size():
    # What the aten mapping target inlines: no hstu node, no data-dependent shapes, B=1 accepted.
    ep = torch.export.export(
        _AttentionReference(), _batch([3, 5, 7]), dynamic_shapes=_dynamic_shapes(), strict=False
    )
    assert _hstu_nodes(ep.graph) == []
    assert all("item" not in str(n.target) for n in ep.graph.nodes)
    for lengths in ([9], [2, 12], [1, 4, 16, 3, 8]):
        args = _batch(lengths, seed=len(lengths))
        torch.testing.assert_close(ep.module()(*args), _Attention()(*args), rtol=1e-6, atol=1e-7)


class _ReferencesByKeyword(torch.nn.Module):
    """Calls the references the way ``passes/map_ops.py`` does: keywords named as in the op schema."""

    def forward(self, q, k, v, offsets, num_targets, delta_q):
        scalars = dict(max_seq_len=16, scaling_seqlen=16, alpha=0.5, num_targets=num_targets,
                       contextual_seq_len=1, max_attn_len=4)  # fmt: skip
        full = hstu_mha_reference(q=q, k=k, v=v, seq_offsets=offsets, causal=True, **scalars)
        cached = cached_hstu_mha_reference(
            delta_q=delta_q, k=k, v=v, seq_offsets=offsets, delta_size=2, **scalars
        )
        return full, cached


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_references_trace_with_fx_proxies(dtype):
    # FX proxies hide rank, shape and dtype; the traced graph must still compute the same numbers.
    gm = torch.fx.symbolic_trace(_ReferencesByKeyword())
    assert _hstu_nodes(gm.graph) == []
    for lengths in ([2, 7, 3], [5]):
        q, k, v, offsets = make_inputs(lengths, dtype=dtype)
        targets = torch.tensor([1] * len(lengths))
        rows = _last_rows(offsets, 2)
        full, cached = gm(q, k, v, offsets, targets, q[rows])
        kwargs = dict(max_seq_len=16, scaling_seqlen=16, alpha=0.5, num_targets=targets,
                      contextual_seq_len=1, max_attn_len=4)  # fmt: skip
        torch.testing.assert_close(full, hstu_mha(q, k, v, offsets, **kwargs))
        torch.testing.assert_close(cached, cached_hstu_mha(q[rows], k, v, offsets, delta_size=2, **kwargs))
        assert full.dtype == cached.dtype == dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_op_equals_attention_then_gate(dtype):
    # hstu_mha_gated is the STU layer between its projections: split, SiLU, attention, LN, concat.
    gen = torch.Generator().manual_seed(3)
    h, dqk, dv, lengths = 2, 8, 6, [5, 0, 9, 3]
    offsets = lengths_to_offsets(torch.tensor(lengths))
    uvqk = torch.randn(sum(lengths), h * (2 * dv + 2 * dqk), generator=gen).to(dtype)
    weight, bias = (torch.randn(h * dv, generator=gen).to(dtype) for _ in range(2))
    targets = torch.tensor([2, 0, 4, 1])
    attn = dict(max_seq_len=12, scaling_seqlen=10, alpha=0.4, num_targets=targets, contextual_seq_len=1,
                max_attn_len=5)  # fmt: skip
    got = hstu_mha_gated(uvqk, offsets, weight, bias, num_heads=h, attention_dim=dqk, linear_dim=dv, eps=1e-5, **attn)
    u, v, q, k = torch.split(uvqk, [h * dv, h * dv, h * dqk, h * dqk], dim=-1)
    a = hstu_mha(q.reshape(-1, h, dqk), k.reshape(-1, h, dqk), v.reshape(-1, h, dv), offsets, **attn).reshape(-1, h * dv)
    u = torch.nn.functional.silu(u)
    normed = torch.nn.functional.layer_norm(a.float(), (h * dv,), weight.float(), bias.float(), 1e-5).to(dtype)
    expected = torch.cat([u, a, u * normed], dim=-1)
    assert got.dtype == dtype and got.shape == (sum(lengths), 3 * h * dv)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    with pytest.raises(ConfigError, match="num_heads"):
        hstu_mha_gated(uvqk, offsets, weight, bias, num_heads=0, attention_dim=dqk, linear_dim=dv, **attn)


@pytest.mark.parametrize("op_name", ["hstu_mha", "cached_hstu_mha", "hstu_mha_gated"])
def test_opcheck(op_name):
    # Schema, fake kernel, autograd registration and AOT-dispatch tracing (incl. the backward, which
    # must not sync with the host when traced).
    q, k, v, offsets = (
        x.requires_grad_() if x.is_floating_point() else x for x in make_inputs([3, 0, 5, 1], dqk=4, dv=3)
    )
    if op_name == "hstu_mha":
        args = (q, k, v, offsets, 8, 8, 0.5, True, torch.tensor([1, 0, 2, 0]), 1, 2)
    elif op_name == "hstu_mha_gated":
        uvqk = torch.randn(9, 2 * (2 * 3 + 2 * 4), requires_grad=True)  # H=2, Dqk=4, Dv=3
        norm = (torch.randn(6, requires_grad=True), torch.randn(6, requires_grad=True))
        args = (uvqk, offsets, *norm, 2, 4, 3, 8, 8, 0.5, True, torch.tensor([1, 0, 2, 0]), 1, 2, 1e-6)
    else:
        delta_offsets = lengths_to_offsets(torch.tensor([3, 5, 1]))
        args = (q[[2, 7, 8]], k, v, delta_offsets, 1, 8, 8, 0.5, None, 0, 0)
    torch.library.opcheck(getattr(torch.ops.hstu_export, op_name).default, args)


def test_registration_is_idempotent_and_schemas_use_symint():
    import importlib

    import hstu_export.ops.library as library

    importlib.reload(library)  # registering again must be a no-op, not an error
    library.register_ops()
    schema = str(torch.ops.hstu_export.hstu_mha.default._schema)
    assert "SymInt max_seq_len" in schema and "Tensor? num_targets=None" in schema
    assert "SymInt? total_len=None" in str(torch.ops.hstu_export.dense_to_jagged.default._schema)
    q, k, v, offsets = make_inputs([2, 3])
    assert hstu_mha(q, k, v, offsets, max_seq_len=4, scaling_seqlen=4, alpha=1.0).shape == (5, 2, 6)
