"""fuse_stu_gate: an HSTU layer written out by a user (split, SiLU, its own attention, concat of u, a and
u * LayerNorm(a)) becomes our gated attention op for the triton target, with the same results."""

from __future__ import annotations

import pytest
import torch
import torch.fx
from test_user_models import USER_ATTENTION, _flat
from user_models import dlrm_hstu

from hstu_export.capture import trace
from hstu_export.ops.mappings import function_mappings, imported_functions
from hstu_export.passes.context import PassContext
from hstu_export.passes.manager import PipelineResult, run_passes

GR_ATTENTION = "generative_recommenders.ops.pytorch.pt_hstu_attention.pytorch_hstu_mha"


def pipeline(op_target: str, skip: tuple[str, ...] = ()) -> tuple[PipelineResult, dict[str, torch.Tensor]]:
    model = dlrm_hstu.build_ranker()
    schema, flat = _flat(model, dlrm_hstu.example_inputs(3, seed=0))
    mappings = {USER_ATTENTION: GR_ATTENTION}
    gm = trace(model, flat, schema=schema, opaque_functions=imported_functions(list(function_mappings(mappings))))
    ctx = PassContext(example_inputs=schema.to_graph_inputs(flat), schema=schema, op_mappings=mappings,
                      op_target=op_target)
    return run_passes(gm, ctx, skip=skip), schema.to_graph_inputs(flat)


def calls(result: PipelineResult) -> list[str]:
    return [str(n.target) for n in result.dense.graph.nodes if n.op == "call_function"]


def on_the_cpu(result: PipelineResult) -> PipelineResult:
    """Each Triton op swapped for our op of the same schema, whose CPU kernel is the reference (the Triton
    kernels need a GPU; tests/test_triton_kernels.py checks them against the same references)."""
    for half in (result.sparse, result.dense):
        for gm in (m for m in half.modules() if isinstance(m, torch.fx.GraphModule)):
            for node in gm.graph.nodes:
                parts = str(node.target).split(".")  # hstu_export.<op>[.default]
                if node.op == "call_function" and parts[0] == "hstu_export" and parts[1].endswith("_triton"):
                    packet = getattr(torch.ops.hstu_export, parts[1].removesuffix("_triton"))
                    node.target = packet.default if parts[2:] == ["default"] else packet
            gm.recompile()
    return result


def test_the_users_layers_become_the_gated_op() -> None:
    pytest.importorskip("triton")
    result, _ = pipeline("triton")
    unfused, _ = pipeline("triton", skip=("fuse_stu_gate",))
    assert result.report["fuse_stu_gate"].stats["fused"] == 2
    targets, before = calls(result), calls(unfused)
    assert targets.count("hstu_export.hstu_mha_gated_triton.default") == 2
    # The attention and each layer's concat went (with dead code elimination), nothing else did.
    assert "hstu_export.hstu_mha_triton.default" not in targets
    assert before.count("hstu_export.hstu_mha_triton.default") == 2
    assert before.count(str(torch.cat)) - targets.count(str(torch.cat)) == 2


def test_the_fused_graph_computes_what_the_model_does() -> None:
    pytest.importorskip("triton")
    fused, batch = pipeline("triton")
    unfused, _ = pipeline("triton", skip=("fuse_stu_gate",))
    assert "hstu_export.hstu_mha_triton.default" in calls(unfused)
    with torch.no_grad():
        got, plain = on_the_cpu(fused).run(batch), on_the_cpu(unfused).run(batch)
    for name in plain:
        torch.testing.assert_close(got[name], plain[name], rtol=1e-5, atol=1e-6)


def test_other_targets_are_left_as_traced() -> None:
    result, _ = pipeline("aten")
    assert result.report["fuse_stu_gate"].stats == {}
    assert not [t for t in calls(result) if "gated" in t]


def test_a_layer_that_reads_its_attention_elsewhere_is_left_as_traced(monkeypatch: pytest.MonkeyPatch) -> None:
    """The attention's output also feeds something outside the gate: fusing would compute the attention twice,
    so the layer stays as the model wrote it."""
    pytest.importorskip("triton")

    def forward(self, x, offsets, max_seq_len, num_targets):  # type: ignore[no-untyped-def]
        u, v, q, k = torch.split(self.uvqk(self.norm(x)), self.heads * self.head_dim, dim=-1)
        u = torch.nn.functional.silu(u)
        shape = (-1, self.heads, self.head_dim)
        a = dlrm_hstu.jagged_hstu_attention(max_seq_len=max_seq_len, alpha=0.5, q=q.reshape(shape),
                                            k=k.reshape(shape), v=v.reshape(shape), seq_offsets=offsets,
                                            num_targets=num_targets)
        a = a.reshape(x.size(0), -1)
        return x + self.out(torch.cat([u, a, u * self.out_norm(a)], dim=-1)) + a.mean(dim=-1, keepdim=True)

    monkeypatch.setattr(dlrm_hstu.STULayer, "forward", forward)
    result, _ = pipeline("triton")
    assert result.report["fuse_stu_gate"].stats["fused"] == 0
    assert calls(result).count("hstu_export.hstu_mha_triton.default") == 2
