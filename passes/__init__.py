"""Graph passes, one file each, and the one list that orders them; the pass manager (``manager``), what a
pass reads (``context``) and what the manager records of each (``record``); the sparse/dense boundary the
split writes (``boundary``).

Adding a pass = one file here defining a class (``name`` attribute, ``run(gm, ctx) -> gm``, statistics
through ``ctx.add_stat``; set ``recursive = False`` to see only the top graph) + one line in ``PASSES``.
Pass classes are constructed without arguments; their settings come from the ``PassContext``. A pass
that changes the numbers on purpose (quantization) sets ``approximate = True``: ``--check-each-pass``
records its error instead of failing, and checks the passes after it against its result.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hstu_export.errors import ConfigError

if TYPE_CHECKING:
    from hstu_export.passes.context import GraphPass


@dataclass(frozen=True)
class PassSpec:
    name: str
    target: str  # "<module in hstu_export.passes>:<class>"


# The default pipeline, in run order.
PASSES: tuple[PassSpec, ...] = (
    PassSpec("prune_unused", "prune_unused:PruneUnused"),
    PassSpec("observe_values", "observe_values:ObserveValues"),
    PassSpec("mark_sparse_dense", "mark_sparse_dense:MarkSparseDense"),
    PassSpec("split_sparse_dense", "split_sparse_dense:SplitSparseDense"),
    PassSpec("guard_ranges", "guard_ranges:GuardRanges"),
    PassSpec("remove_boundary_marks", "remove_boundary_marks:RemoveBoundaryMarks"),
    # Operator mapping (reads ctx.op_target and ctx.allow_unmapped); runs on both halves after the split.
    PassSpec("map_ops", "map_ops:MapOps"),
    # The length checks map_ops records beside foreign jagged ops: read from the device once, at the end.
    PassSpec("defer_length_checks", "defer_length_checks:DeferLengthChecks"),
    # Sizes and length checks read from the device that a valid request decides: sizes from shapes, checks dropped.
    PassSpec("prove_length_reads", "prove_length_reads:ProveLengthReads"),
    # An HSTU layer's attention and output gate, written out by the model, as our gated op (triton target).
    PassSpec("fuse_stu_gate", "fuse_stu_gate:FuseStuGate"),
    # Sibling MLPs on one input (multi-task heads) as one product per layer; their old modules go with DCE.
    PassSpec("fuse_parallel_mlps", "fuse_parallel_mlps:FuseParallelMlps"),
    # Reduced-precision exports: a layer's floating inputs take its parameters' dtype, as autocast would.
    PassSpec("follow_parameter_dtypes", "follow_parameter_dtypes:FollowParameterDtypes"),
    # CUDA: a Linear whose input rows are not 16-byte multiples reads them padded (cuBLAS's fast kernels).
    PassSpec("align_linear_inputs", "align_linear_inputs:AlignLinearInputs"),
    PassSpec("eliminate_dead_code", "eliminate_dead_code:EliminateDeadCode"),
    # After the rewrites: the quantized tables call fbgemm lookups no pass above should rewrite (a no-op unless asked).
    PassSpec("quantize_embeddings", "quantize_embeddings:QuantizeEmbeddings"),
    # torchrec lookups on per-key request tensors as plain gathers; quantized collections are kept as they are.
    PassSpec("lower_embeddings", "lower_embeddings:LowerEmbeddings"),
)


def known_pass_names() -> list[str]:
    return [spec.name for spec in PASSES]


def default_pass_names() -> list[str]:
    """The default pipeline, in run order."""
    return known_pass_names()


def create_pass(name: str) -> GraphPass:
    """A fresh instance of the registered pass ``name``."""
    spec = next((s for s in PASSES if s.name == name), None)
    if spec is None:
        raise ConfigError(f"unknown pass {name!r}; known passes: {', '.join(known_pass_names())}")
    module_name, _, class_name = spec.target.partition(":")
    return getattr(importlib.import_module(f"{__name__}.{module_name}"), class_name)()
