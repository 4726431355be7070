"""``--kv-cache`` for models other than the zoo's: the delta program derived from the traced dense half
(:mod:`hstu_export.kv_derive`), compiled with AOTInductor into the package beside the no-cache programs,
and its verification by scripted requests served through the package's cache (docs/KV_CACHE.md)."""

from __future__ import annotations

import operator
import time
from collections.abc import Callable, Collection, Hashable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from hstu_export.errors import ConfigError, ExportError
from hstu_export.kv_derive import (
    TARGET_ROWS,
    DerivedDelta,
    delta_inputs,
    derive_delta,
    gathered_jagged,
    generic_ops,
    prefill_rows,
)
from hstu_export.kv_export import delta_inductor_options, page_table_width_bound
from hstu_export.runtimes.base import DimSpec, torch_dynamic_shapes
from hstu_export.runtimes.compiled_bounds import narrowed_dims, program_bounds, recording_input_bounds

KV_DELTA_FILE = "kv/delta.pt2"
KV_COUNTS_FILE = "kv/counts.pt2"  # AOTInductor, as the delta program: C++ loads both
DERIVED = "derived"
GROWN = "the histories grown by a token"
NEW_CANDIDATES = "the same histories with new candidates"
# A delta program with the sparse half inside takes the tables it reads as inputs named thus, then a number.
TABLE_INPUT = "kv_table_"

# Inductor options the derived program is compiled with on CUDA, under the user's --aoti-option. It is tuned on
# its export example, run once (Inductor's two-pass AOT compile), not on the generated tensors of compile-time
# autotuning: those hold zeros and size hints, from which the program's gathers compute rows outside their tables
# (a device-side assert in a fused gather). Not the written program's `combo_kernels`
# (kv_export.DELTA_INDUCTOR_OPTIONS): Inductor's combined kernels refuse its reductions over data-dependent sizes.
DERIVED_CUDA_OPTIONS: dict[str, bool | int | float | str] = {"triton.autotune_at_compile_time": False}


def derive_for_export(result: Any, inputs: Any, op_target: str) -> DerivedDelta:
    """The delta program of ``result`` (the pipeline run again at the ``triton`` target, so that each attention
    is one node; a gated one is read as the attention and its gate, :func:`~hstu_export.kv_derive.ungate`),
    lowered to ``op_target``; ConfigError when the model cannot be cached. ``inputs``: the no-cache export's
    CompileInputs (whose dense inputs, example and dynamic dims are the delta program's too). Runs before
    anything is compiled, so that a refusal comes at once."""
    from hstu_export.passes.context import PassContext
    from hstu_export.passes.map_ops import MapOps

    dense = generic_ops(result.dense)
    names = [n.target for n in dense.graph.nodes if n.op == "placeholder"]
    if names != inputs.dense_input_names:
        raise ExportError(f"--kv-cache: the dense half traced again takes {names}, not {inputs.dense_input_names}")
    never_empty = [name for name, dims in inputs.dense_dynamic_dims.items()
                   if inputs.example_dense_inputs[name].dim() > 0 and (
                       dims[0].min * dims[0].scale + dims[0].offset >= 1 if 0 in dims
                       else inputs.example_dense_inputs[name].shape[0] >= 1)]  # fmt: skip
    keys = row_keys(inputs)
    example = {**inputs.example_dense_inputs, **{k: inputs.example_features[k] for ids in keys.values() for k in ids}}
    derived = derive_delta(dense, example, op_target=op_target, never_empty_inputs=never_empty, row_keys=keys)
    derived.program = MapOps().run(gathered_jagged(derived.program), PassContext(example_inputs={}, op_target=op_target))
    derived.program.recompile()
    return derived


def row_keys(inputs: Any) -> dict[str, list[str]]:
    """The dense inputs the sparse half looked up row by row from request ids (:mod:`hstu_export.lookup_keys`),
    each with those ids: integer request inputs with as many rows as it, on the example and in the ranges (the
    same dynamic dim)."""
    from hstu_export.lookup_keys import looked_up_ids

    boundary = [n for n in inputs.dense_input_names if n not in inputs.example_features]
    found = looked_up_ids(inputs.sparse, boundary)
    dense, features = inputs.example_dense_inputs, inputs.example_features

    def same_rows(name: str, ids: str) -> bool:
        value, key = dense[name], features.get(ids)
        return (isinstance(key, Tensor) and key.dim() >= 1 and value.dim() >= 1 and key.shape[0] == value.shape[0]
                and not key.is_floating_point() and key.dtype != torch.bool
                and inputs.sparse_dynamic_dims.get(ids, {}).get(0) == inputs.dense_dynamic_dims.get(name, {}).get(0))

    return {name: ids for name, ids in found.items() if all(same_rows(name, k) for k in ids)}


def sparse_inside(program: torch.fx.GraphModule, sparse: torch.fx.GraphModule, boundary: list[str],
                  tables: Collection[str]) -> tuple[torch.fx.GraphModule, dict[str, str]] | None:
    """``program`` (a derived delta program) with the sparse half inside it: each of its inputs that the sparse
    half computes (``boundary``, in the order ``sparse`` returns them where it returns a tuple) computed from the
    request by ``sparse``'s nodes, and the tables ``sparse`` reads taken as inputs. Returns the program and its
    table inputs (input name -> the table's name among the package's ``tables``). A lookup whose rows the program
    reads at its new rows alone (a frontier value compared as its ids) then runs on those rows only, the gather
    fused into it, and one it never reads is not run. None where ``sparse`` returns something else, calls a
    module or reads a value that is not one of ``tables``."""
    nodes = list(sparse.graph.nodes)
    (result,) = next(n for n in nodes if n.op == "output").args
    returned = dict(result) if isinstance(result, dict) else (
        dict(zip(boundary, result, strict=True)) if isinstance(result, (tuple, list)) and len(result) == len(boundary)
        else {})
    read = list(dict.fromkeys(str(n.target) for n in nodes if n.op == "get_attr"))
    if (any(name not in returned for name in boundary) or any(n.op == "call_module" for n in nodes)
            or any(name not in tables for name in read)):
        return None
    graph = torch.fx.Graph()
    own: dict[torch.fx.Node, torch.fx.Node] = {}
    for p in program.graph.nodes:
        if p.op == "placeholder" and p.target not in boundary:
            own[p] = graph.placeholder(str(p.target))
            own[p].meta = dict(p.meta)
    taken = {str(n.target): n for n in own.values()}
    added: list[torch.fx.Node] = []
    copied: dict[torch.fx.Node, torch.fx.Node] = {}
    for p in (n for n in nodes if n.op == "placeholder"):
        if str(p.target) not in taken:
            taken[str(p.target)] = graph.placeholder(str(p.target))
            added.append(taken[str(p.target)])
        copied[p] = taken[str(p.target)]
    table_inputs = {f"{TABLE_INPUT}{i}": name for i, name in enumerate(read)}
    by_table = {name: graph.placeholder(input_name) for input_name, name in table_inputs.items()}
    added += by_table.values()
    for n in (n for n in nodes if n.op == "get_attr"):
        copied[n] = by_table[str(n.target)]
    before = set(copied)
    outputs = graph.graph_copy(sparse.graph, copied)
    made = [copied[n] for n in nodes if n not in before and n.op != "output"]
    env = {**own, **{p: outputs[p.target] for p in program.graph.nodes if p.op == "placeholder" and p.target in boundary}}
    graph.output(graph.graph_copy(program.graph, env))
    # The sparse half's work the program does not read, and the inputs only that work read: gone (the rest of the
    # program is left to the compiler, which knows which of its calls write the cache's pages).
    for n in reversed(made):
        if not n.users:
            graph.erase_node(n)
    for p in added:
        if not p.users:
            graph.erase_node(p)
    remaining = {str(p.target) for p in graph.nodes if p.op == "placeholder"}
    return (torch.fx.GraphModule(program, graph),
            {name: table for name, table in table_inputs.items() if name in remaining})


def _with_sparse_inside(derived: DerivedDelta, inputs: Any, artifacts: Any,
                        ) -> tuple[torch.fx.GraphModule, dict[str, str]] | None:  # fmt: skip
    """:func:`sparse_inside` of ``derived``'s program, where the package's sparse half is a compiled program with
    a prechecked model (the runtimes check each request's ranges on the host first, so that the program, which
    clamps ids as that model does, reads nothing back from the device) and its tables stored outside it (handed to
    the delta program as inputs too), and the counts read request inputs alone; else None."""
    from hstu_export.runtimes.aoti import prechecked_sparse

    meta = artifacts.meta.get("sparse_program") or {}
    tables = [t["name"] for t in (artifacts.constants.get("sparse") or {}).get("tensors", [])]
    boundary = [n for n in inputs.dense_input_names if n not in inputs.example_features]
    counts = [str(n.target) for n in derived.counts.graph.nodes if n.op == "placeholder"]
    if (artifacts.formats.get("sparse") != "aoti" or not meta.get("prechecked") or not tables
            or any(name in boundary for name in counts)):
        return None
    prechecked = prechecked_sparse(inputs.sparse)
    if prechecked is None:
        return None
    return sparse_inside(derived.program, prechecked[0], boundary, tables)


def compile_derived_delta(derived: DerivedDelta, inputs: Any, settings: Any, out_dir: Path,
                          artifacts: Any, feature_names: dict[str, str]) -> dict[str, Any]:
    """Export and compile ``derived`` (:func:`derive_for_export`) into ``out_dir`` (the package being built);
    returns the manifest's ``kv_cache`` section. ``artifacts``: the package's compiled halves (the backend's
    BackendArtifacts), whose sparse half the program holds inside it where :func:`_with_sparse_inside` can;
    ``feature_names``: each request feature's name by its graph name."""
    from hstu_export.capture.opaque import export_builtins
    from hstu_export.runtimes.graph_io import export_ready, plain_first_line
    from hstu_export.runtimes.residual_norms import fuse_residual_norms
    from hstu_export.runtimes.unbacked_ranges import device_reads, unbacked_ranges_hold_at_one

    start = time.perf_counter()
    program = derived.program
    example = {**inputs.example_dense_inputs, **{k: inputs.example_features[k] for k in derived.key_inputs}}
    names = [*inputs.dense_input_names, *derived.key_inputs]
    table_inputs: dict[str, str] = {}
    inside = _with_sparse_inside(derived, inputs, artifacts)
    if inside is not None:
        program, table_inputs = inside
        names = [str(p.target) for p in program.graph.nodes if p.op == "placeholder"
                 and p.target not in delta_inputs(derived)]
        example = {**inputs.example_features, **{name: operator.attrgetter(table)(inputs.sparse).detach()
                                                  for name, table in table_inputs.items()}}
    page_size, device = settings.kv_page_size, settings.torch_device
    width_bound = page_table_width_bound(derived.max_seq_len, page_size)
    batch = _batch_dim(derived.counts, inputs)
    users = example[next(n.target for n in derived.counts.graph.nodes if n.op == "placeholder")].shape[0]
    width, pages = 2, 2 * users + 1
    kv_example = {
        "kv_cached": torch.zeros(users, dtype=torch.int64, device=device),
        "kv_k_pages": torch.zeros(derived.num_layers, pages, page_size, derived.num_heads, derived.attention_dim,
                                  dtype=settings.torch_dtype, device=device),
        "kv_v_pages": torch.zeros(derived.num_layers, pages, page_size, derived.num_heads, derived.linear_dim,
                                  dtype=settings.torch_dtype, device=device),
        "kv_x_pages": torch.zeros(pages, page_size, derived.row_width, dtype=derived.row_dtype, device=device),
        "kv_page_table": torch.arange(users * width, dtype=torch.int32, device=device).reshape(users, width),
        # nothing cached: every row is new (kv_new_rows, and kv_target_rows where the program takes it)
        **{name: rows.to(device) for name, rows in prefill_rows(derived.counts, example)[1].items()
           if name in delta_inputs(derived)},
    }
    pages_dim = DimSpec("kv_pages", 2, 2**31 - 1)
    dims = {**{k: inputs.sparse_dynamic_dims[k] for k in names if k in inputs.sparse_dynamic_dims},
            **inputs.dense_dynamic_dims,
            "kv_cached": {0: batch}, "kv_k_pages": {1: pages_dim},
            "kv_v_pages": {1: pages_dim}, "kv_x_pages": {0: pages_dim},
            "kv_page_table": {0: batch, 1: DimSpec("kv_page_table_width", 1, width_bound)},
            "kv_new_rows": {0: DimSpec("kv_new_rows", 0, batch.max * derived.max_seq_len)},
            TARGET_ROWS: {0: DimSpec(TARGET_ROWS, 0, batch.max * derived.max_seq_len)}}
    all_names = [*names, *delta_inputs(derived)] if inside is None else [
        str(p.target) for p in program.graph.nodes if p.op == "placeholder"]  # the program's own order
    # In the manifest's order: a caller without names (the C++ runtime) passes the inputs in that order.
    kwargs = {name: {**example, **kv_example}[name] for name in all_names}
    try:
        with torch.no_grad(), export_builtins(set(inputs.user_packages)), unbacked_ranges_hold_at_one():
            exported = torch.export.export(export_ready(program, fold_parameters=True), args=(), kwargs=kwargs, strict=False,
                                           dynamic_shapes=torch_dynamic_shapes(all_names, dims))
            residual_norms = fuse_residual_norms(exported) if derived.op_target == "triton" else 0
            counts_names = [n.target for n in derived.counts.graph.nodes if n.op == "placeholder"]
            counts = torch.export.export(derived.counts, args=(), kwargs={n: example[n] for n in counts_names},
                                         dynamic_shapes=torch_dynamic_shapes(counts_names, dims), strict=False)
    except Exception as exc:
        raise ExportError(f"torch.export of the derived KV-cache delta program failed: {plain_first_line(exc)}") from exc
    (out_dir / KV_DELTA_FILE).parent.mkdir(parents=True, exist_ok=True)
    options = delta_inductor_options(device, settings.aoti_options, DERIVED_CUDA_OPTIONS)
    try:
        with unbacked_ranges_hold_at_one():
            with recording_input_bounds() as delta_bounds:
                torch._inductor.aoti_compile_and_package(exported, package_path=str(out_dir / KV_DELTA_FILE),
                                                         inductor_configs=dict(options))
            with recording_input_bounds() as counts_bounds:
                torch._inductor.aoti_compile_and_package(counts, package_path=str(out_dir / KV_COUNTS_FILE))
    except Exception as exc:
        raise ExportError(f"AOTInductor compilation of the derived KV-cache delta program failed: "
                          f"{plain_first_line(exc)}") from exc
    # Where Inductor held a declared dim to less (runtimes/compiled_bounds.py): export narrows the users to it.
    narrowed = [*narrowed_dims("KV-cache delta", program_bounds(exported, delta_bounds), dims),
                *narrowed_dims("KV-cache counts", program_bounds(counts, counts_bounds), dims)]
    with torch.no_grad():
        returned = list(program(**kwargs))  # the compiled program returns its outputs in this order
    feature_dims = {name: spec[0] for name, spec in {**inputs.sparse_dynamic_dims, **inputs.dense_dynamic_dims}.items()
                    if name in inputs.example_features and 0 in spec}
    rows_of = padding_rows(exported, returned, dims, feature_dims)
    if rows_of is not None:  # the manifest names request features as requests do
        rows_of = {name: feature_names.get(follows, follows) for name, follows in rows_of.items()}
    sums = derived.host_counts
    # The counts as sums of request features (the runtimes add them up on the host: no counts program, no read
    # back from the device before the delta program), where every input they read comes from the request.
    on_host = sums if sums is not None and all(
        name in inputs.example_features for part in sums.values() for name in part["terms"]) else None
    return {
        "kind": DERIVED,
        "program": KV_DELTA_FILE,
        "counts_program": KV_COUNTS_FILE,
        "inputs": all_names,
        "counts_inputs": counts_names,
        "outputs": returned,
        "page_size": page_size,
        "max_seq_len": derived.max_seq_len,
        "layout": derived.layout(),
        "frontier": derived.frontier,
        **({"compared_ids": derived.compared_ids} if derived.compared_ids else {}),
        **({"sparse_inside": {"tables": table_inputs}} if inside is not None else {}),
        "target_inputs": derived.target_inputs,
        "layer_nodes": derived.layer_nodes,
        "fused": {"gated_attention": derived.gated_fused, "last_layer_on_targets": derived.targets_only,
                  "residual_norms": residual_norms},
        **({"counts_on_host": on_host} if on_host is not None else {}),
        # Checked by the export's verification, which drops it where a padding user changes the answers.
        **({"padding": {"rows_of": rows_of}} if rows_of is not None else {}),
        "device_reads": device_reads(exported),
        "inductor_options": options,
        "compile_seconds": round(time.perf_counter() - start, 3),
        **({"narrowed_dims": [d.to_json() for d in narrowed]} if narrowed else {}),
    }


def padding_rows(exported: Any, outputs: list[str], dims: dict[str, dict[int, Any]],
                 feature_dims: dict[str, Any]) -> dict[str, str] | None:
    """For each output of the exported delta program, the input whose rows its rows follow: a request feature
    (by graph name here, by its own name in the manifest), ``kv_cached`` (a row a user) or ``kv_target_rows``, or ``""`` for an output whose shape no
    user changes; read off the program's symbolic shapes, where an output's first dim is an input's. None where
    an output's rows follow none of them (a padding user's rows could not be told from the others':
    ``serving/kv_padding.py``). ``feature_dims``: each request feature's first dim (a DimSpec), by graph name,
    through which an input that is not one (the sparse half's rows) is matched with the feature it follows."""
    from hstu_export.serving.kv_padding import UNCHANGED

    graph = exported.graph_module.graph
    users = set(exported.graph_signature.user_inputs)
    firsts = {str(n.name): str(n.meta["val"].shape[0]) for n in graph.nodes
              if n.op == "placeholder" and n.name in users and getattr(n.meta.get("val"), "ndim", 0) > 0}
    # Request features first: the padding user's rows of each are known; then the cache's own per-user inputs.
    order = [*(name for name in firsts if name in feature_dims), "kv_cached", TARGET_ROWS]
    values = [a.meta.get("val") for a in graph.output_node().args[0]]
    if len(values) != len(outputs):
        return None
    rows_of: dict[str, str] = {}
    for name, value in zip(outputs, values, strict=True):
        if not isinstance(value, Tensor) or value.ndim == 0 or isinstance(value.shape[0], int):
            rows_of[name] = UNCHANGED
            continue
        first = str(value.shape[0])
        follows = next((n for n in order if firsts.get(n) == first), None)
        if follows is None:  # an input of the dense half's: the feature its first dim is declared as
            spec = next((dims[n][0] for n, f in firsts.items() if f == first and 0 in dims.get(n, {})), None)
            follows = next((n for n, d in feature_dims.items() if spec is not None and d == spec), None)
        if follows is None:
            return None
        rows_of[name] = follows
    return rows_of


def _batch_dim(counts: torch.fx.GraphModule, inputs: Any) -> DimSpec:
    """The batch's dynamic dim: dim 0 of a per-user input the sequence counts are computed from."""
    for node in counts.graph.nodes:
        spec = inputs.dense_dynamic_dims.get(node.target, {}).get(0) if node.op == "placeholder" else None
        example = inputs.example_dense_inputs.get(node.target)
        if spec is not None and example is not None and example.dim() == 1 and spec.scale == 1 and not spec.offset:
            return spec
    raise ConfigError("--kv-cache: the attentions' sequence lengths are not computed from per-user lengths of the "
                      "request; the cache cannot tell each user's tokens")


# -- verification ---------------------------------------------------------------------------------------


def verification_requests(schema: Any, target_inputs: list[str], max_batch: int, seed: int,
                          ) -> list[tuple[str, list[Hashable], dict[str, Tensor]]]:  # fmt: skip
    """(what it checks, user ids, request) in serving order, within the package's ranges: a prefill whose
    histories are a token shorter, then the whole histories (a hit where the model lets a grown history keep
    its prefix, stale otherwise); the same users reordered (every one a hit); their histories with new
    candidates (the lengths the target counts come from, ``target_inputs``, and the features that share or
    follow them, drawn again); new content under known ids (stale, or a hit where the rows the layers start
    from did not change); a new user beside a cached one."""
    from hstu_export.verification.batch import generate_batch

    n = max(1, min(3, max_batch))
    first = generate_batch(schema, n, seed=seed)
    order = list(reversed(range(n)))
    candidates = {f.name for f in schema.lengths_features() if f.graph_name in target_inputs}
    candidates |= {f.name for f in schema.lengths_features() if schema.canonical_lengths(f.name) in candidates}
    kept = {f.name: first[f.name] for f in schema.lengths_features() if f.name not in candidates and not f.same_as}
    again = generate_batch(schema, n, seed=seed + 2, lengths=kept)
    ids = [f"verify-user-{i}" for i in range(n)]
    shorter = _shortened(schema, first, candidates)
    steps = [("prefill (every user a miss)", ids, first if shorter is None else shorter)]
    if shorter is not None:
        steps.append((GROWN, ids, first))
    steps += [
        ("the same users reordered (hits)", [ids[i] for i in order],
         {name: _users(schema, first, order, name) for name in first}),
    ]
    if candidates:
        steps.append((NEW_CANDIDATES, ids,
                      {f.name: (again if f.name in candidates or f.jagged_by in candidates else first)[f.name]
                       for f in schema.features}))
    steps.append(("new content under the same ids", ids, generate_batch(schema, n, seed=seed + 1)))
    if n > 1:
        newcomer = generate_batch(schema, 1, seed=seed + 3)
        steps.append(("a new user with a cached one", ["verify-user-new", ids[0]],
                      {name: torch.cat([newcomer[name], _users(schema, first, [0], name)]) for name in first}))
    return steps


def _shortened(schema: Any, batch: dict[str, Tensor], candidates: set[str]) -> dict[str, Tensor] | None:
    """``batch`` with each user's history a token shorter where its lengths allow (the jagged features of every
    lengths feature but the candidates'), None where no history can be."""
    cut: dict[str, Tensor] = {}
    for f in schema.lengths_features():
        if f.name in candidates or f.same_as:
            continue
        lengths = batch[f.name].to(torch.int64)
        shorter = torch.clamp(lengths - 1, min=max(f.min_value or 0, 0))
        if not torch.equal(shorter, lengths):
            cut[f.name] = shorter
    if not cut:
        return None
    out = dict(batch)
    for f in schema.features:
        source = schema.canonical_lengths(f.name) if f.kind == "lengths" else (
            schema.canonical_lengths(f.jagged_by) if f.kind == "jagged" else None)
        if source not in cut:
            continue
        if f.kind == "lengths":
            out[f.name] = cut[source].to(batch[f.name].dtype)
            continue
        lengths = batch[f.jagged_by].to(torch.int64)
        starts = torch.cumsum(lengths, 0) - lengths
        keep = torch.cat([torch.arange(int(start), int(start + n), dtype=torch.int64)
                          for start, n in zip(starts, cut[source], strict=True)])
        out[f.name] = batch[f.name][keep]
    return out


def _users(schema: Any, batch: dict[str, Tensor], order: list[int], name: str) -> Tensor:
    """Feature ``name`` of ``batch`` for the users ``order`` (rows of a jagged feature follow its lengths)."""
    f = schema.get(name)
    value = batch[name]
    if f.kind != "jagged":
        return value[order]
    lengths = batch[f.jagged_by].to(torch.int64)
    starts = torch.cumsum(lengths, 0) - lengths
    parts = [value[int(starts[i]):int(starts[i] + lengths[i])] for i in order]
    return torch.cat(parts) if parts else value[:0]


def verify_derived_kv_cache(predictor: Any, reference: Callable[[dict[str, Tensor]], dict[str, Tensor]],
                            tolerances: dict[str, float], seed: int) -> dict[str, Any]:
    """Serve :func:`verification_requests` through the package's cache, in order, each answer compared with
    ``reference`` (the user's model on the whole request): ``check_parity``'s record plus the cache's
    counters; it fails when no request was served from the cache."""
    from hstu_export.verification.parity import check_parity

    section = predictor.manifest["kv_cache"]
    ranker = predictor.kv_cache()
    steps = verification_requests(predictor.input_schema, section["target_inputs"], predictor.max_batch_size, seed)
    users_of = {what: ids for what, ids, _ in steps}
    current: list[str] = []
    report = check_parity(lambda batch: ranker(batch, users_of[current[-1]]), reference,
                          [(what, batch) for what, _, batch in steps], tolerances, on_batch=current.append)
    report["cache"] = ranker.cache.stats()
    if not any(what == NEW_CANDIDATES for what, _, _ in steps):
        report["not_checked"] = [f"{NEW_CANDIDATES}: the attentions count no target tokens, so no request input "
                                 f"says which tokens are candidates"]
    if report["cache"]["hits"] == 0:
        report["passed"] = False  # nothing was served from the cache: the delta path went unchecked
    if "padding" in section:
        report["padding"] = verify_padding(predictor, reference, tolerances, seed)
    return report


def verify_padding(predictor: Any, reference: Callable[[dict[str, Tensor]], dict[str, Tensor]],
                   tolerances: dict[str, float], seed: int) -> dict[str, Any]:
    """The package's shape buckets checked (``kv_cache.padding``, ``serving/kv_padding.py``): the verification
    requests, of at most one user fewer than the package's batch, served through a cache whose every call has a
    padding user, each answer compared with ``reference``. ``passed`` False (the export then drops the
    padding: the program runs each shape as it is) where an answer differs, or where a request found no padding
    user within the package's ranges."""
    from hstu_export.verification.parity import check_parity, mismatch_summary

    section = predictor.manifest["kv_cache"]
    if predictor.max_batch_size < 2:
        return {"passed": False, "reason": "a batch of one user leaves no room for a padding user"}
    ranker = predictor.kv_cache(shape_buckets=True)
    steps = verification_requests(predictor.input_schema, section["target_inputs"], predictor.max_batch_size - 1,
                                  seed)
    users_of = {what: ids for what, ids, _ in steps}
    current: list[str] = []
    report = check_parity(lambda batch: ranker(batch, users_of[current[-1]]), reference,
                          [(what, batch) for what, _, batch in steps], tolerances, on_batch=current.append)
    report["padded"] = ranker.padded_calls
    if ranker.padded_calls < len(steps):
        report["passed"] = False
        report["reason"] = (f"{len(steps) - ranker.padded_calls} of {len(steps)} requests found no padding user "
                            f"whose lengths are within the package's ranges")
    elif not report["passed"]:
        report["reason"] = f"a padding user changes the answers: {mismatch_summary(report)}"
    return report
