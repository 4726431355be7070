"""Cases that need Triton's CPU interpreter: run by tests/test_paged_attention.py in a subprocess with
TRITON_INTERPRET=1 (not collected by the main run: the file name does not start with test_)."""

from __future__ import annotations

import os

import pytest
import torch
from test_kv_cache import CONTEXT, NO_CONTEXT, check_every_kind_of_delta
from test_paged_attention import (
    CASES,
    _call,
    _case,
    _expected,
    _pools,
    _stored,
    check_attention_inputs,
    check_store,
    check_store_past_the_table,
)

from hstu_export.models.config import HSTUConfig

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1 (tests/test_paged_attention.py does)"


@pytest.mark.parametrize("splits", [1, 3, 7, None])  # 7: more slices than some ranges have key blocks
@pytest.mark.parametrize("name", list(CASES))
def test_triton_kernel_equals_full_attention_rows(name: str, splits: int) -> None:
    from hstu_export.ops._triton.paged import paged_hstu_mha_triton_fwd

    q_lens, seq_lens, targets, contextual, window = CASES[name]
    case = _case(q_lens, seq_lens, targets, seed=len(name))
    got = _call(paged_hstu_mha_triton_fwd, case, contextual, window, 128, 0.25, max_seq_len=max(seq_lens),
                max_query_len=max(q_lens), splits=splits)
    want = _expected(case, contextual, window, 128, 0.25)
    assert not got.isnan().any()  # nothing outside a user's pages was read
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("splits", [1, None])
def test_triton_kernel_with_pages_larger_than_a_key_block(splits: int) -> None:
    """Pages of 128 tokens hold two or more key blocks: a block's page and its offset in the page."""
    from hstu_export.ops._triton.configs import attention_config
    from hstu_export.ops._triton.paged import paged_hstu_mha_triton_fwd

    assert attention_config(None, 16, 16, torch.float32).block_n < 128
    case = _case([5, 40, 1], [300, 170, 129], [5, 8, 1], page_size=128, seed=11)
    got = _call(paged_hstu_mha_triton_fwd, case, 0, 0, 512, 0.25, max_seq_len=300, max_query_len=40, splits=splits)
    want = _expected(case, 0, 0, 512, 0.25)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_triton_kernel_bf16() -> None:
    from hstu_export.ops._triton.paged import paged_hstu_mha_triton_fwd

    case = _case([9, 20], [61, 45], [4, 6], dtype=torch.bfloat16, seed=5)
    got = _call(paged_hstu_mha_triton_fwd, case, 2, 0, 128, 0.25, max_seq_len=61, max_query_len=20, splits=2)
    want = _expected({**case, **{x: case[x].double() for x in ("q", "k", "v")}}, 2, 0, 128, 0.25)
    err = (got.double() - want).norm() / want.norm()
    assert err < 1e-2, err


def _kernel_store(q, k, v, q_offsets, k_pool, v_pool, layer, *rest, **extra):  # type: ignore[no-untyped-def]
    """The kernel's launcher in paged_hstu_mha_store's signature (the layer positional)."""
    from hstu_export.ops._triton.paged import paged_hstu_mha_triton_fwd

    return paged_hstu_mha_triton_fwd(q, k, v, q_offsets, k_pool, v_pool, *rest, layer=layer, **extra)


@pytest.mark.parametrize("splits", [1, None])
@pytest.mark.parametrize("name", list(CASES))
def test_triton_kernel_stores_the_new_non_target_rows(name: str, splits: int) -> None:
    """The kernel's store (the last slice of each query block) writes what the reference does, bit for bit."""
    q_lens, seq_lens = CASES[name][:2]
    check_store(_kernel_store, name, max_seq_len=max(seq_lens), max_query_len=max(q_lens), splits=splits)


def test_triton_kernel_store_skips_tokens_past_the_table() -> None:
    check_store_past_the_table(_kernel_store, max_seq_len=40, max_query_len=10, splits=2)


@pytest.mark.parametrize("config", [NO_CONTEXT, CONTEXT], ids=["no-context", "context"])
def test_cached_ranker_on_the_triton_kernel(config: HSTUConfig) -> None:
    check_every_kind_of_delta(config)


class _LayerOp:
    """A CASES entry as the delta program's layer op takes it (uvqk: random u, the case's new rows' v, q, k; a
    random gate norm), run on fresh pools (layer 1 of 2)."""

    def __init__(self, name: str, splits: int | None) -> None:
        self.q_lens, self.seq_lens, self.targets, self.contextual, self.window = CASES[name]
        self.case = _case(self.q_lens, self.seq_lens, self.targets, seed=len(name))
        self.splits = splits
        rows = self.case["rows"]
        q, v = self.case["q"], self.case["v"]
        self.h, self.dqk, self.dv = q.shape[1], q.shape[2], v.shape[2]
        gen = torch.Generator().manual_seed(len(name))
        self.u = torch.randn(len(rows), self.h * self.dv, generator=gen)
        self.uvqk = torch.cat([self.u, v[rows].flatten(1), q[rows].flatten(1), self.case["k"][rows].flatten(1)], -1)
        self.weight, self.bias = torch.randn(self.h * self.dv, generator=gen), torch.randn(self.h * self.dv, generator=gen)

    def run(self, target_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(result, K pool, V pool) after the op."""
        from hstu_export.ops._triton.paged import paged_hstu_mha_gated_triton_fwd

        c = self.case
        k_pool, v_pool = _pools(c, layer=1)
        got = paged_hstu_mha_gated_triton_fwd(
            self.uvqk, c["q_offsets"], k_pool, v_pool, 1, c["table"], c["seq_lens"], c["targets"], self.weight,
            self.bias, 1e-6, self.h, self.dqk, self.dv, 128, 0.25, self.contextual, self.window,
            max_seq_len=max(self.seq_lens), max_query_len=max(self.q_lens), splits=self.splits,
            gate_rows=1 if self.splits is None else None, target_rows=target_rows,  # a row a program, as on a GPU
        )  # fmt: skip
        return got, k_pool, v_pool

    def reference(self) -> torch.Tensor:
        """Reference attention over the whole sequences at the new rows, then the model's gate."""
        from hstu_export.ops.reference import stu_gate

        a = _expected(self.case, self.contextual, self.window, 128, 0.25).flatten(1)
        return stu_gate(self.u, a, self.weight, self.bias, 1e-6)

    def check_stored(self, k_pool: torch.Tensor, v_pool: torch.Tensor) -> None:
        """The new non-target tokens' K/V in their pages, bit for bit, and nothing else written."""
        want_k, want_v = _stored(self.case, *_pools(self.case, layer=1), 1)
        torch.testing.assert_close(k_pool[:, :-1], want_k[:, :-1], rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(v_pool[:, :-1], want_v[:, :-1], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("splits", [1, 3, None])
@pytest.mark.parametrize("name", list(CASES))
def test_gated_kernels_equal_the_attention_then_the_gate(name: str, splits: int | None) -> None:
    """The delta program's layer op on the Triton path (the attention writing into the gate's concat, the gate
    summing the key slices): the attention third bit for bit as the attention kernel alone (whose slices
    _sum_slices adds in the same order), the whole as the reference attention then the model's gate, and the
    new K/V stored as the store op stores them."""
    from hstu_export.ops._triton.paged import paged_hstu_mha_triton_fwd

    op = _LayerOp(name, splits)
    got, k_pool, v_pool = op.run()
    alone = _call(paged_hstu_mha_triton_fwd, op.case, op.contextual, op.window, 128, 0.25,
                  max_seq_len=max(op.seq_lens), max_query_len=max(op.q_lens), splits=splits)
    width = op.h * op.dv
    assert got.shape == (len(op.case["rows"]), 3 * width) and not got.isnan().any()
    assert torch.equal(got[:, width:2 * width], alone.flatten(1))
    torch.testing.assert_close(got, op.reference(), rtol=1e-5, atol=1e-5)
    op.check_stored(k_pool, v_pool)


@pytest.mark.parametrize("splits", [1, 3, None])
@pytest.mark.parametrize("name", list(CASES))
def test_gated_kernels_on_the_targets_only(name: str, splits: int | None) -> None:
    """The layer op asked for the targets' rows only (a model's last layer): the targets' rows of the whole
    op's result, user by user, and every new non-target token's K/V stored all the same (users without a
    target, or without any new token, included)."""
    op = _LayerOp(name, splits)
    ends = op.case["q_offsets"][1:].tolist()
    wanted = torch.tensor([end - t + r for end, t in zip(ends, op.targets) for r in range(t)], dtype=torch.int64)
    whole, whole_k, whole_v = op.run()
    got, k_pool, v_pool = op.run(wanted)
    assert got.shape == (len(wanted), 3 * op.h * op.dv) and not got.isnan().any()
    torch.testing.assert_close(got, whole[wanted], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got, op.reference()[wanted], rtol=1e-5, atol=1e-5)
    op.check_stored(k_pool, v_pool)
    op.check_stored(whole_k, whole_v)


@pytest.mark.parametrize("config", [NO_CONTEXT, CONTEXT], ids=["no-context", "context"])
def test_cached_ranker_with_the_gated_kernels(config: HSTUConfig) -> None:
    """The delta run with the Triton program's layer op (attention and gate in one call): every kind of delta
    still equals the full model."""
    from hstu_export.kv_export import gated_attention_for

    check_every_kind_of_delta(config, gated_attention=gated_attention_for("triton"))


def test_triton_attention_inputs() -> None:
    """The kernel that computes the attention's inputs once for every layer equals the PyTorch version."""
    from hstu_export.ops._triton.paged import paged_attention_inputs_triton

    check_attention_inputs(paged_attention_inputs_triton)


@pytest.mark.parametrize("rows", [1, 7, 37])
def test_add_layer_norm_kernel_equals_the_sum_and_its_norm(rows: int) -> None:
    """The residual kernel's sum equals x + y, and its norm the model's fp32 layer norm of that sum: bit for bit
    in fp32; in bf16 within one unit in the last place, as the interpreter rounds fp32 to bf16 its own way (10
    of 48 values differed by one unit in a probe; the GPU rounds to nearest even, as torch does)."""
    from hstu_export.models.stu import LAYER_NORM_EPS, layer_norm_fp32
    from hstu_export.ops._triton.residual import add_layer_norm_triton_fwd

    gen = torch.Generator().manual_seed(rows)
    for dtype in (torch.float32, torch.bfloat16):
        x, y = (torch.randn(rows, 48, generator=gen).to(dtype) for _ in range(2))
        w, b = torch.randn(48, generator=gen), torch.randn(48, generator=gen)
        total, normed = add_layer_norm_triton_fwd(x, y, w, b, LAYER_NORM_EPS)
        assert total.dtype == normed.dtype == dtype
        if dtype == torch.float32:
            assert torch.equal(total, x + y)
            torch.testing.assert_close(normed, layer_norm_fp32(x + y, w, b), rtol=1e-5, atol=1e-5)
        else:
            torch.testing.assert_close(total, x + y, rtol=2**-7, atol=0)
            torch.testing.assert_close(normed.float(), layer_norm_fp32(total, w, b).float(), rtol=2**-7, atol=2**-7)


@pytest.mark.parametrize("config", [NO_CONTEXT, CONTEXT], ids=["no-context", "context"])
def test_cached_ranker_with_the_residual_kernel(config: HSTUConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    """The delta run with the Triton program's residual (a product, then the sum-and-norm op) between layers:
    every kind of delta still equals the full model."""
    from hstu_export.kv_export import residual_for
    from hstu_export.models import cached

    monkeypatch.setattr(cached, "residual_then_norm", residual_for("triton"))
    check_every_kind_of_delta(config)


def test_a_derived_program_runs_each_attention_and_its_gate_as_one_op_and_answers_the_same() -> None:
    """The zoo's tiny model derived for the triton target: each layer's paged attention and STU gate become the
    fused op (no stu_gate and no separate paged attention left), and its cached answers (a first request, then
    the same histories with new candidates: hits) equal the model's, as the aten program's do."""
    import tempfile
    from pathlib import Path

    from test_fuse_stu_gate import on_the_cpu

    import hstu_export
    from hstu_export.exporter import _compile_inputs, capture
    from hstu_export.kv_derive import paged_gated_attention_triton, stu_gate
    from hstu_export.kv_derived_export import derive_for_export
    from hstu_export.models import build_preset
    from hstu_export.serving.kv_derived import DerivedCachedRanker, EagerDerived

    model = build_preset("tiny", seed=0)
    schema = model.input_schema()
    with tempfile.TemporaryDirectory() as tmp:
        bundle = hstu_export.load_bundle(hstu_export.save_bundle(model, Path(tmp) / "zoo.pt",
                                                                 hstu_export.generate_batch(schema, 2, seed=1)))
    settings = hstu_export.ExportSettings(backend="aoti", kv_cache=True, kv_program="derived", max_batch_size=4)
    with torch.no_grad():
        captured = capture(bundle, settings, "triton")
        result = on_the_cpu(captured.result)
        inputs = _compile_inputs(result, captured.schema.to_graph_inputs(captured.example), captured.schema,
                                 captured.ranges, settings)
        programs = {target: derive_for_export(on_the_cpu(capture(bundle, settings, "triton").result), inputs, target)
                    for target in ("triton", "aten")}
    calls = [n.target for n in programs["triton"].program.graph.nodes if n.op == "call_function"]
    assert calls.count(paged_gated_attention_triton) == model.config.num_layers and stu_gate not in calls
    assert (programs["triton"].gated_fused, programs["aten"].gated_fused) == (model.config.num_layers, 0)
    assert programs["triton"].targets_only and programs["aten"].targets_only  # the last layer: the targets' rows

    def dense_inputs(request: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The dense inputs, and the request's features (the ids the programs compare their frontier rows as)."""
        graph = captured.schema.to_graph_inputs(request)
        sparse = result.sparse(**{t.name: graph[t.name] for t in result.boundary.sparse_inputs})
        return {**graph, **{t.name: sparse[t.name] if t.source == "sparse" else graph[t.name]
                            for t in result.boundary.dense_inputs}}

    whole = hstu_export.generate_batch(schema, 2, seed=11, lengths={"uih_lengths": [12, 9], "candidate_lengths": [3, 2]})
    again = hstu_export.generate_batch(schema, 2, seed=12, lengths={"uih_lengths": [12, 9], "candidate_lengths": [2, 4]})
    again = {**again, **{k: v for k, v in whole.items() if k.startswith("uih_") or k in ("query_time", "user_id",
                                                                                          "user_age")}}
    rankers = {target: DerivedCachedRanker(EagerDerived(dense_inputs, derived), budget_bytes="4MiB", page_size=16)
               for target, derived in programs.items()}
    for request in (whole, again):
        with torch.no_grad():
            given = dense_inputs(request)
            want = result.dense(**{name: given[name] for name in inputs.dense_input_names})
            got = {target: ranker(request, [1, 2]) for target, ranker in rankers.items()}
        for name in want:
            for target in got:
                torch.testing.assert_close(got[target][name], want[name], rtol=1e-4, atol=1e-5)
    assert [r.cache.stats()["hits"] for r in rankers.values()] == [2, 2]


def test_a_layer_written_out_by_the_model_is_fused_in_its_derived_program_too() -> None:
    """gr_style writes its gate out (split, SiLU, the attention, concat of u, a and u * LN(a)): fuse_stu_gate makes
    it our gated op, the derivation reads that as the attention and its gate, and the derived program for the
    triton target runs them as one op; its cached answers (a first request, then a hit) equal the model's."""
    from test_fuse_stu_gate import GR_ATTENTION, on_the_cpu
    from test_kv_derive import gr_user, new_candidates
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
    from user_models import gr_style

    from hstu_export.capture import trace
    from hstu_export.kv_derive import derive_delta, generic_ops, paged_gated_attention_triton, stu_gate
    from hstu_export.ops.mappings import function_mappings, imported_functions
    from hstu_export.passes.context import PassContext
    from hstu_export.passes.manager import run_passes
    from hstu_export.serving.kv_derived import DerivedCachedRanker, EagerDerived
    from hstu_export.sources.schema_inference import flatten_example, infer_schema

    model = gr_style.build_cacheable_ranker()
    example = gr_style.example_inputs([10, 5, 7], [3, 1, 2])
    schema = infer_schema(model, example, ranges=gr_style.RANGES)
    flat = flatten_example(schema, example, None, model)
    mappings = {gr_style.ATTENTION: GR_ATTENTION}
    gm = trace(model, flat, schema=schema, opaque_functions=imported_functions(list(function_mappings(mappings))))
    result = on_the_cpu(run_passes(gm, PassContext(example_inputs=schema.to_graph_inputs(flat), schema=schema,
                                                   op_mappings=mappings, op_target="triton")))

    def dense_inputs(request: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        graph = schema.to_graph_inputs(request)
        sparse = result.sparse(**{t.name: graph[t.name] for t in result.boundary.sparse_inputs})
        return {t.name: sparse[t.name] if t.source == "sparse" else graph[t.name] for t in result.boundary.dense_inputs}

    derived = derive_delta(generic_ops(result.dense), dense_inputs(flat), op_target="triton")
    calls = [n.target for n in derived.program.graph.nodes if n.op == "call_function"]
    assert calls.count(paged_gated_attention_triton) == 2 and stu_gate not in calls and derived.targets_only

    def request(users: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
        kjts = [KeyedJaggedTensor.from_lengths_sync(
            keys=keys, values=torch.cat([torch.tensor(u[k], dtype=torch.int64) for k in keys for u in users]),
            lengths=torch.tensor([len(u[k]) for k in keys for u in users]))
            for keys in (gr_style.UIH_KEYS, gr_style.CANDIDATE_KEYS)]
        return flatten_example(schema, tuple(kjts), None, model)

    ranker = DerivedCachedRanker(EagerDerived(dense_inputs, derived), budget_bytes="4MiB", page_size=16)
    a, b = gr_user(1, 8, 3), gr_user(2, 4, 1)
    for users in ([a, b], [new_candidates(a, 5, ["cand_item_id"]), b]):
        batch = request(users)
        with torch.no_grad():
            got, want = ranker(batch, [1, 2]), result.dense(**dense_inputs(batch))
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5)
    assert ranker.cache.stats()["hits"] == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_residual_norms_rewrite_serves_through_the_kernel(dtype: torch.dtype) -> None:
    """An exported program rewritten by runtimes/residual_norms.py runs the residual kernel itself (here on the
    CPU, the kernel interpreted) and answers as the program did before: both layer ends of tests/test_residual_norms.py
    (an add of a product, an addmm); in bf16 within a unit in the last place of the operands (the addmm's product
    is rounded before its sum, and a sum near zero keeps that unit)."""
    from test_residual_norms import FUSED, Layers, calls, exported

    from hstu_export.runtimes.residual_norms import fuse_residual_norms

    program, args = exported(Layers(), dtype, rows=37)
    want = program.module()(*args)
    assert fuse_residual_norms(program, devices=("cpu",)) == 2 and calls(program).count(FUSED) == 2
    got = program.module()(*args)
    for a, b in zip(want, got, strict=True):
        assert a.dtype == b.dtype == dtype
        rtol, atol = (1e-5, 1e-5) if dtype == torch.float32 else (2**-7, 2**-4)  # operands of a few units
        torch.testing.assert_close(b.float(), a.float(), rtol=rtol, atol=atol)
