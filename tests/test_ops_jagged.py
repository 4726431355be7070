"""Jagged ops: loop-defined semantics, round trips, fbgemm parity, export with dynamic dims."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.export import Dim

from hstu_export.ops import (
    Kernel,
    concat_2D_jagged,
    dense_to_jagged,
    jagged_to_padded_dense,
    lengths_to_offsets,
    split_2D_jagged,
)
from hstu_export.ops import jagged_positions as jagged_positions_op
from hstu_export.ops.jagged import fbgemm_available, jagged_positions_by_search
from hstu_export.ops.reference import (
    concat_2D_jagged_reference,
    dense_to_jagged_reference,
    jagged_positions,
    jagged_to_padded_dense_reference,
    split_2D_jagged_reference,
)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
LENGTH_SETS = {"uneven": [3, 0, 7, 1], "batch1": [5], "all_empty": [0, 0]}


def offsets_of(lengths, device="cpu"):
    return lengths_to_offsets(torch.tensor(lengths, dtype=torch.int64)).to(device)


def jagged(lengths, dim=4, dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(sum(lengths), dim, generator=gen).to(device=device, dtype=dtype)
    return values, offsets_of(lengths, device)


def loop_padded(values, lengths, max_len, padding_value):
    out = torch.full((len(lengths), max_len, *values.shape[1:]), padding_value, dtype=values.dtype)
    start = 0
    for b, n in enumerate(lengths):
        keep = min(n, max_len)
        out[b, :keep] = values[start : start + keep]
        start += n
    return out


def loop_concat(left, left_lengths, right, right_lengths):
    rows, a, b = [], 0, 0
    for n_left, n_right in zip(left_lengths, right_lengths):
        rows += [left[a : a + n_left], right[b : b + n_right]]
        a, b = a + n_left, b + n_right
    return torch.cat(rows)


# ---- offsets, positions ------------------------------------------------------------------------


def test_lengths_to_offsets():
    assert lengths_to_offsets(torch.tensor([3, 0, 2], dtype=torch.int32)).tolist() == [0, 3, 3, 5]
    assert lengths_to_offsets(torch.tensor([3, 0, 2])).dtype == torch.int64
    assert lengths_to_offsets(torch.tensor([4])).tolist() == [0, 4]
    assert lengths_to_offsets(torch.tensor([], dtype=torch.int64)).tolist() == [0]


def test_jagged_positions_with_empty_sequences():
    seq_ids, positions = jagged_positions(offsets_of([0, 2, 0, 3, 0]), 5)
    assert seq_ids.tolist() == [1, 1, 3, 3, 3]
    assert positions.tolist() == [0, 1, 0, 1, 2]


@pytest.mark.parametrize("lengths", [[0, 2, 0, 3, 0], [7], [1, 1, 1], [0], [4, 0, 0, 9, 2, 5]])
def test_jagged_positions_op_and_search_equal_the_running_count(lengths):
    offsets = offsets_of(lengths)
    total = sum(lengths)
    expected = jagged_positions(offsets, total)
    for got in (
        jagged_positions_op(offsets, total),  # the op (eager: the running count)
        jagged_positions_op(offsets, total, kernel=Kernel.TRITON),  # the search, what triton maps to
        jagged_positions_by_search(offsets.to(torch.int32), total),
    ):
        assert [g.tolist() for g in got] == [e.tolist() for e in expected]
        assert all(g.dtype == torch.int64 for g in got)


def test_jagged_positions_search_keeps_ids_in_range_for_inconsistent_offsets():
    # All-zero offsets (what AOTInductor feeds kernels while compiling): every token lies past
    # offsets[B]. The running count says sequence B; the search clamps to B-1 so that per-sequence
    # lookups stay in bounds.
    seq_ids, positions = jagged_positions_by_search(torch.zeros(4, dtype=torch.int64), 5)
    assert seq_ids.tolist() == [2] * 5 and positions.tolist() == [0, 1, 2, 3, 4]
    assert jagged_positions(torch.zeros(4, dtype=torch.int64), 5)[0].tolist() == [3] * 5


# ---- jagged <-> padded -------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(LENGTH_SETS))
def test_padded_round_trip(name, device):
    lengths = LENGTH_SETS[name]
    values, offsets = jagged(lengths, device=device)
    padded = jagged_to_padded_dense(values, offsets, max_len=8, padding_value=-1.5)
    assert padded.shape == (len(lengths), 8, 4)
    torch.testing.assert_close(padded.cpu(), loop_padded(values.cpu(), lengths, 8, -1.5), rtol=0, atol=0)
    back = dense_to_jagged(padded, offsets)
    torch.testing.assert_close(back, values, rtol=0, atol=0)
    back = dense_to_jagged(padded, offsets, total_len=values.shape[0])
    torch.testing.assert_close(back, values, rtol=0, atol=0)


def test_truncation_semantics():
    lengths = [2, 6, 4]
    values, offsets = jagged(lengths)
    padded = jagged_to_padded_dense(values, offsets, max_len=3)
    torch.testing.assert_close(padded, loop_padded(values, lengths, 3, 0.0), rtol=0, atol=0)
    # Back to jagged, positions past the padded size come out as zeros.
    back = dense_to_jagged(padded, offsets)
    expected = values.clone()
    expected[[5, 6, 7, 11]] = 0.0  # positions 3.. of sequence 1 (rows 2-7) and 3 of sequence 2
    torch.testing.assert_close(back, expected, rtol=0, atol=0)


@pytest.mark.parametrize("shape", [(), (2, 3)], ids=["1d", "3d"])
def test_values_with_other_ranks(shape):
    lengths = [3, 1, 4]
    values = torch.randn(8, *shape)
    offsets = offsets_of(lengths)
    padded = jagged_to_padded_dense(values, offsets, max_len=5, padding_value=7.0)
    assert padded.shape == (3, 5, *shape)
    torch.testing.assert_close(padded, loop_padded(values, lengths, 5, 7.0), rtol=0, atol=0)
    torch.testing.assert_close(dense_to_jagged(padded, offsets), values, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_eager_op_equals_reference(dtype):
    values, offsets = jagged([3, 0, 7, 1], dtype=dtype)
    for max_len in (4, 9):
        padded = jagged_to_padded_dense(values, offsets, max_len=max_len, padding_value=2.0)
        ref = jagged_to_padded_dense_reference(values, offsets, max_len, 2.0)
        torch.testing.assert_close(padded, ref, rtol=0, atol=0)
        torch.testing.assert_close(
            dense_to_jagged(padded, offsets), dense_to_jagged_reference(padded, offsets), rtol=0, atol=0
        )


@pytest.mark.skipif(not fbgemm_available(), reason="fbgemm_gpu is not importable; pure torch only")
def test_fbgemm_unsupported_dtype_falls_back_to_pure_torch():
    from hstu_export.ops.jagged import _FBGEMM_UNSUPPORTED

    values, offsets = jagged([2, 3], dtype=torch.float64)  # fbgemm has no fp64 kernels
    padded = jagged_to_padded_dense(values, offsets, max_len=3)
    torch.testing.assert_close(padded, loop_padded(values, [2, 3], 3, 0.0), rtol=0, atol=0)
    assert ("jagged_to_padded_dense", "cpu", torch.float64) in _FBGEMM_UNSUPPORTED


@pytest.mark.skipif(not fbgemm_available(), reason="fbgemm_gpu is not importable; pure torch only")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_pure_torch_equals_fbgemm(dtype):
    values, offsets = jagged([3, 0, 7, 1, 12], dim=5, dtype=dtype)
    for max_len in (1, 6, 16):
        fb = torch.ops.fbgemm.jagged_to_padded_dense(values, [offsets], [max_len], -3.0)
        ours = jagged_to_padded_dense_reference(values, offsets, max_len, -3.0)
        torch.testing.assert_close(ours, fb, rtol=0, atol=0)
        fb_back = torch.ops.fbgemm.dense_to_jagged(fb, [offsets], values.shape[0])[0]
        torch.testing.assert_close(
            dense_to_jagged_reference(fb, offsets, values.shape[0]), fb_back, rtol=0, atol=0
        )


# ---- concat / split ----------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("left_lengths", "right_lengths"),
    [([3, 0, 2, 5], [1, 4, 0, 2]), ([4], [2]), ([0, 0], [1, 0]), ([2, 3], [0, 0])],
)
def test_concat_then_split(left_lengths, right_lengths, device):
    left, left_offsets = jagged(left_lengths, device=device, seed=1)
    right, right_offsets = jagged(right_lengths, device=device, seed=2)
    joined = concat_2D_jagged(left, left_offsets, right, right_offsets)
    expected = loop_concat(left.cpu(), left_lengths, right.cpu(), right_lengths)
    torch.testing.assert_close(joined.cpu(), expected, rtol=0, atol=0)
    a, b = split_2D_jagged(joined, left_offsets, right_offsets, left.shape[0], right.shape[0])
    torch.testing.assert_close(a, left, rtol=0, atol=0)
    torch.testing.assert_close(b, right, rtol=0, atol=0)


def test_concat_output_offsets_are_the_sum():
    left, left_offsets = jagged([2, 1], seed=3)
    right, right_offsets = jagged([1, 3], seed=4)
    joined = concat_2D_jagged(left, left_offsets, right, right_offsets)
    out_offsets = left_offsets + right_offsets
    padded = jagged_to_padded_dense(joined, out_offsets, max_len=4)
    torch.testing.assert_close(padded[1, :4], torch.cat([left[2:3], right[1:4]]), rtol=0, atol=0)


def test_gradients_flow_through_jagged_ops():
    left, left_offsets = jagged([2, 3], seed=5)
    right, right_offsets = jagged([1, 2], seed=6)
    left.requires_grad_()
    right.requires_grad_()
    joined = concat_2D_jagged(left, left_offsets, right, right_offsets)
    padded = jagged_to_padded_dense(joined, left_offsets + right_offsets, max_len=5)
    a, b = split_2D_jagged(
        dense_to_jagged(padded, left_offsets + right_offsets), left_offsets, right_offsets, 5, 3
    )
    (a * 2).sum().backward(retain_graph=True)
    torch.testing.assert_close(left.grad, torch.full_like(left, 2.0))
    assert right.grad is None or right.grad.abs().sum() == 0
    (b * 3).sum().backward()
    torch.testing.assert_close(right.grad, torch.full_like(right, 3.0))


# ---- export with dynamic dims ------------------------------------------------------------------


class _JaggedOps(torch.nn.Module):
    """Jagged ops as called by a model: the total lengths come from input shapes (SymInts)."""

    def __init__(self, use_reference: bool) -> None:
        super().__init__()
        self.use_reference = use_reference

    def forward(self, left, left_offsets, right, right_offsets):
        if self.use_reference:
            joined = concat_2D_jagged_reference(left, left_offsets, right, right_offsets)
            a, b = split_2D_jagged_reference(joined, left_offsets, right_offsets, left.size(0), right.size(0))
            return joined, a, b
        joined = concat_2D_jagged(left, left_offsets, right, right_offsets)
        a, b = split_2D_jagged(joined, left_offsets, right_offsets, left.size(0), right.size(0))
        return joined, a, b


def _args(left_lengths, right_lengths):
    return (*jagged(left_lengths, seed=7), *jagged(right_lengths, seed=8))


def _dynamic_shapes():
    batch = Dim("B", min=1, max=256)
    return {
        "left": {0: Dim("La", min=1, max=4096)},
        "left_offsets": {0: batch + 1},
        "right": {0: Dim("Lb", min=1, max=4096)},
        "right_offsets": {0: batch + 1},
    }


def _hstu_targets(ep) -> list:
    return [n.target for n in ep.graph.nodes if n.op == "call_function" and "hstu" in str(n.target)]


@pytest.mark.parametrize("use_reference", [False, True], ids=["ops", "reference"])
def test_export_concat_split_dynamic(use_reference):
    module = _JaggedOps(use_reference)
    ep = torch.export.export(
        module, _args([3, 1, 4], [2, 2, 1]), dynamic_shapes=_dynamic_shapes(), strict=False
    )
    if use_reference:
        assert _hstu_targets(ep) == []
    else:
        assert _hstu_targets(ep) == [
            torch.ops.hstu_export.concat_2D_jagged.default,
            torch.ops.hstu_export.split_2D_jagged.default,
        ]
    for left_lengths, right_lengths in (([5], [2]), ([1, 7], [3, 1]), ([2, 2, 2, 2, 9], [1, 1, 1, 1, 4])):
        args = _args(left_lengths, right_lengths)
        for got, want in zip(ep.module()(*args), module(*args)):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        torch.testing.assert_close(
            ep.module()(*args)[0], loop_concat(args[0], left_lengths, args[2], right_lengths)
        )


class _Padding(torch.nn.Module):
    def __init__(self, use_reference: bool) -> None:
        super().__init__()
        self.use_reference = use_reference

    def forward(self, values, offsets):
        if self.use_reference:
            padded = jagged_to_padded_dense_reference(values, offsets, 8, 0.0)
            return padded, dense_to_jagged_reference(padded * 2, offsets, values.size(0))
        padded = jagged_to_padded_dense(values, offsets, 8)
        return padded, dense_to_jagged(padded * 2, offsets, values.size(0))


def _backed_size_oblivious():
    # A [B, ...] output whose B is offsets.size(0) - 1 makes torch.export guard B != 1 unless sizes
    # are treated size-obliviously; the export pass is expected to turn this on.
    config = torch.fx.experimental._config
    if not hasattr(config, "backed_size_oblivious"):
        return contextlib.nullcontext()
    return config.patch(backed_size_oblivious=True)


@pytest.mark.parametrize("use_reference", [False, True], ids=["ops", "reference"])
def test_export_padding_dynamic_batch_including_1(use_reference):
    module = _Padding(use_reference)
    shapes = {"values": {0: Dim("L", min=1, max=4096)}, "offsets": {0: Dim("B", min=1, max=256) + 1}}
    with _backed_size_oblivious():
        ep = torch.export.export(module, jagged([3, 1, 4]), dynamic_shapes=shapes, strict=False)
    expected_nodes = [] if use_reference else [
        torch.ops.hstu_export.jagged_to_padded_dense.default, torch.ops.hstu_export.dense_to_jagged.default,
    ]  # fmt: skip
    assert _hstu_targets(ep) == expected_nodes
    for lengths in ([6], [1, 9], [2, 0, 5, 8]):
        args = jagged(lengths, seed=len(lengths))
        padded, back = ep.module()(*args)
        torch.testing.assert_close(padded, loop_padded(args[0], lengths, 8, 0.0), rtol=0, atol=0)
        expected_back = dense_to_jagged_reference(loop_padded(args[0], lengths, 8, 0.0) * 2, args[1])
        torch.testing.assert_close(back, expected_back, rtol=0, atol=0)


def test_export_dense_to_jagged_without_total_len_gives_unbacked_size():
    class ToJagged(torch.nn.Module):
        def forward(self, dense, offsets):
            return dense_to_jagged(dense, offsets)

    dense = torch.randn(3, 5, 2)
    offsets = offsets_of([2, 5, 1])
    shapes = {"dense": {0: Dim("B", min=1, max=64)}, "offsets": {0: Dim("B1", min=2, max=65)}}
    ep = torch.export.export(ToJagged(), (dense, offsets), dynamic_shapes=shapes, strict=False)
    assert _hstu_targets(ep) == [torch.ops.hstu_export.dense_to_jagged.default]
    out_size = next(n for n in ep.graph.nodes if n.op == "output").args[0][0].meta["val"].shape[0]
    assert str(out_size).startswith("u")  # unbacked: the size comes from offsets' data
    torch.testing.assert_close(ep.module()(dense, offsets), dense_to_jagged_reference(dense, offsets))


class _JaggedReferencesByKeyword(torch.nn.Module):
    """Calls the references the way ``passes/map_ops.py`` does: keywords named as in the op schema."""

    def forward(self, values, offsets, right, right_offsets):
        padded = jagged_to_padded_dense_reference(
            values=values, offsets=offsets, max_len=6, padding_value=-1.0
        )
        back = dense_to_jagged_reference(dense=padded, offsets=offsets, total_len=values.size(0))
        joined = concat_2D_jagged_reference(
            values_left=values, offsets_left=offsets, values_right=right, offsets_right=right_offsets
        )
        left_again, right_again = split_2D_jagged_reference(
            values=joined, offsets_left=offsets, offsets_right=right_offsets,
            total_len_left=values.size(0), total_len_right=right.size(0),
        )  # fmt: skip
        return padded, back, joined, left_again, right_again


@pytest.mark.parametrize("shape", [(), (3,), (2, 3)], ids=["1d", "2d", "3d"])
def test_references_trace_with_fx_proxies(shape):
    # FX proxies hide rank and shape; empty sequences and an empty batch (L = 0) must still work.
    gm = torch.fx.symbolic_trace(_JaggedReferencesByKeyword())
    for left_lengths, right_lengths in (([3, 0, 8], [1, 2, 0]), ([0, 0], [0, 0]), ([4], [0])):
        values = torch.randn(sum(left_lengths), *shape)
        right = torch.randn(sum(right_lengths), *shape)
        offsets, right_offsets = offsets_of(left_lengths), offsets_of(right_lengths)
        padded, back, joined, left_again, right_again = gm(values, offsets, right, right_offsets)
        torch.testing.assert_close(padded, loop_padded(values, left_lengths, 6, -1.0), rtol=0, atol=0)
        expected_back = values.clone()
        start = 0
        for n in left_lengths:  # positions >= max_len come back as zeros
            expected_back[start + 6 : start + n] = 0
            start += n
        torch.testing.assert_close(back, expected_back, rtol=0, atol=0)
        torch.testing.assert_close(
            joined, loop_concat(values, left_lengths, right, right_lengths), rtol=0, atol=0
        )
        torch.testing.assert_close(left_again, values, rtol=0, atol=0)
        torch.testing.assert_close(right_again, right, rtol=0, atol=0)


def _opcheck_cases() -> dict[str, tuple]:
    offsets, right_offsets = offsets_of([3, 0, 5, 1]), offsets_of([1, 2, 0, 3])
    values, right = torch.randn(9, 3), torch.randn(6, 3)
    return {
        "jagged_to_padded_dense": (values, offsets, 4, 0.5),
        "dense_to_jagged": (torch.randn(4, 6, 3), offsets, 9),
        "dense_to_jagged_no_total_len": (torch.randn(4, 6, 3), offsets, None),
        "concat_2D_jagged": (values, offsets, right, right_offsets),
        "split_2D_jagged": (torch.randn(15, 3), offsets, right_offsets, 9, 6),
        "jagged_positions": (offsets, 9),
    }


@pytest.mark.parametrize("case", list(_opcheck_cases()))
def test_opcheck(case):
    # Schema, fake kernel, autograd registration and AOT-dispatch tracing (incl. the backward).
    args = _opcheck_cases()[case]
    args = tuple(
        a.requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args
    )
    op = getattr(torch.ops.hstu_export, case.removesuffix("_no_total_len")).default
    torch.library.opcheck(op, args)
