"""``--kv-cache``: the package also carries the model's delta program, for KV-cached serving.

The delta program (:class:`hstu_export.models.cached.DeltaProgram`) runs a request's new tokens (fresh
history and candidates) against each user's cached K/V, returns the model's outputs and writes the new
tokens' K/V into the cache's pages (its page-pool inputs are mutated in place). With nothing cached for
a user it is that user's prefill: one program serves hits, misses and mixed batches. It is exported with
dynamic shapes (every size follows from its inputs: users, users with nothing cached, new history tokens,
candidates, cache pages, page-table width) and compiled by AOTInductor into ``kv/delta.pt2`` beside the
package's ordinary (no-cache) programs.

Verification then serves scripted requests through the package's own cache (prefill, a hit with new
candidates only, one new token, a history grown across requests and across a page, reordered users, a
new user mixed with cached ones) and compares every answer with the user's model on the whole request.

Scope: the zoo's :class:`~hstu_export.models.ranking.HstuRankingModel` (the delta path is written for
its layers) and the AOTInductor backend. The programs are built from the model's modules, not traced
through the pass pipeline: the attention is chosen by the op target (our Triton kernel reading the
pages for ``triton``, plain aten ops padded to the exported bounds for ``aten``).
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from hstu_export.errors import ConfigError, ExportError
from hstu_export.models.cached import (
    PROGRAM_INPUTS,
    DeltaProgram,
    GatedAttention,
    KVLayout,
    ResidualNorm,
    stacked_contextual,
)
from hstu_export.models.ranking import (
    CANDIDATE_LENGTHS,
    HISTORY_LENGTHS,
    HISTORY_TOKEN_FEATURES,
    HstuRankingModel,
)
from hstu_export.models.stu import LAYER_NORM_EPS
from hstu_export.runtimes.compiled_bounds import (
    KEEPING_DECLARED_RANGES,
    recording_input_bounds,
    refuse_narrowed,
)
from hstu_export.runtimes.unbacked_ranges import unbacked_ranges_hold_at_one

KV_DELTA_FILE = "kv/delta.pt2"
KV_INPUTS = ("kv_cached", "kv_k_pages", "kv_v_pages", "kv_page_table")
MAX_PAGES = 1 << 24  # the exported bound on a cache's pages (the budget sets the real count at load)
EXAMPLE_USERS = 16  # the most users the export example may need to make its sizes distinct


# Inductor options the delta program is compiled with on CUDA, under the user's --aoti-option: its small
# independent kernels (the counts' scans, the embeddings' casts, the heads' outputs) launched as one kernel
# each group, three launches fewer a call (H100: docs/PERF_INVESTIGATIONS.md, "KV-cached serving: the paged attention's
# launch choices").
DELTA_INDUCTOR_OPTIONS: dict[str, bool | int | float | str] = {"combo_kernels": True}


def delta_inductor_options(device: torch.device, user: dict[str, Any],
                           cuda_defaults: dict[str, Any] = DELTA_INDUCTOR_OPTIONS) -> dict[str, Any]:
    """A delta program's Inductor options on ``device``: every compile's :data:`KEEPING_DECLARED_RANGES`,
    ``cuda_defaults`` (the written program's, :data:`DELTA_INDUCTOR_OPTIONS`, unless given) on CUDA, then the
    user's (``--aoti-option``), which win."""
    return {**KEEPING_DECLARED_RANGES, **(cuda_defaults if device.type == "cuda" else {}), **user}


def check_kv_cache(backend: str) -> None:
    """Refuse ``--kv-cache`` where it cannot be built, before any work. Whether a model other than the zoo's
    can be cached is found when its delta program is derived (hstu_export/kv_derive.py)."""
    if backend != "aoti":
        raise ConfigError(f"--kv-cache builds an AOTInductor delta program; use --backend aoti (not {backend})")


def kv_bounds(model: HstuRankingModel, ranges: Any) -> tuple[int, int]:
    """(longest sequence, most new tokens per user) the exported program accepts: contextual + history +
    candidates, within the package's ranges; a prefill is all new."""
    total = (model.config.contextual_seq_len + ranges.max_lengths[HISTORY_LENGTHS]
             + ranges.max_lengths[CANDIDATE_LENGTHS])
    return total, total


def page_table_width_bound(max_seq_len: int, page_size: int) -> int:
    """The widest page table the program accepts: a whole sequence's pages, and at least 64 (room for the
    export example's width and for serving's rounding up to a power of two)."""
    return max(-(-max_seq_len // page_size), 64)


def attention_for(op_target: str, splits: int = 0) -> Callable[..., Tensor]:
    """The paged attention the program calls, which also stores each layer's new K/V: our Triton kernel
    (``triton``) or plain aten (else)."""
    if op_target == "triton":
        import hstu_export.ops._triton  # noqa: F401  (registers hstu_export::paged_hstu_mha_store_triton)

        def triton_attention(*args: Any, max_seq_len: int, max_query_len: int) -> Tensor:
            return torch.ops.hstu_export.paged_hstu_mha_store_triton(*args, max_seq_len, max_query_len, splits)

        return triton_attention
    from hstu_export.ops.paged import paged_hstu_mha_store_reference

    return functools.partial(paged_hstu_mha_store_reference)


def gated_attention_for(op_target: str, splits: int = 0) -> GatedAttention | None:
    """A layer's attention and output gate in one call (:data:`~hstu_export.models.cached.GatedAttention`):
    for ``triton``, our op, whose gate kernel also sums the attention's key slices (no kernel of their own,
    and the attention written once); else None: the attention, then the model's gate."""
    if op_target != "triton":
        return None
    import hstu_export.ops._triton  # noqa: F401  (registers hstu_export::paged_hstu_mha_gated_store_triton)

    def triton_gated_attention(*args: Any, max_seq_len: int, max_query_len: int,
                               target_rows: Tensor | None = None) -> Tensor:
        return torch.ops.hstu_export.paged_hstu_mha_gated_store_triton(*args, max_seq_len, max_query_len, splits,
                                                                        target_rows)

    return triton_gated_attention


def attention_inputs_for(op_target: str) -> Callable[..., tuple[Tensor, ...]]:
    """What computes the attention's inputs once for every layer, with the same choice as
    :func:`attention_for`: one Triton kernel (``triton``; its outputs are buffers the layers' kernels read as
    they are) or plain aten."""
    if op_target == "triton":
        import hstu_export.ops._triton  # noqa: F401  (registers hstu_export::paged_attention_inputs_triton)

        return torch.ops.hstu_export.paged_attention_inputs_triton
    from hstu_export.ops.paged import paged_attention_inputs_reference

    return paged_attention_inputs_reference


def residual_for(op_target: str) -> ResidualNorm | None:
    """What lies between two layers of the program (:data:`~hstu_export.models.cached.ResidualNorm`): for
    ``triton``, a plain product and our kernel for the sum and the next norm (no copy of the residual into
    the product's output); else None, the model's own (an addmm, then the norm)."""
    if op_target != "triton":
        return None
    import hstu_export.ops._triton  # noqa: F401  (registers hstu_export::add_layer_norm_triton)

    def add_then_norm(x: Tensor, gated: Tensor, weight: Tensor, norm_weight: Tensor,
                      norm_bias: Tensor) -> tuple[Tensor, Tensor]:  # fmt: skip
        total, normed = torch.ops.hstu_export.add_layer_norm_triton(x, gated @ weight, norm_weight, norm_bias,
                                                                     LAYER_NORM_EPS)
        return total, normed

    return add_then_norm


def heads_for(model: HstuRankingModel) -> torch.nn.Module:
    """The program's task heads: the model's, with the pipeline's fusion of parallel MLPs (the no-cache
    program gets it from the pass of that name), so that both programs run the heads alike."""
    from hstu_export.passes.fuse_parallel_mlps import fused_module

    weight = model.transducer.post_norm_weight
    return fused_module(model.task_heads, weight.new_zeros(2, model.config.embedding_dim))


def example_inputs(model: HstuRankingModel, ranges: Any, page_size: int, device: torch.device,
                   seed: int) -> dict[str, Tensor]:
    """A delta request for torch.export: two users with nothing cached, the others with a few tokens;
    every dynamic size >= 2 and different from the others (so that none is specialised to a constant or
    unified with another), whatever the package's length ranges."""
    from hstu_export.verification.batch import generate_batch

    layout = KVLayout.of(model)
    max_hist, max_cand = ranges.max_lengths[HISTORY_LENGTHS], ranges.max_lengths[CANDIDATE_LENGTHS]
    # Some users may bring no new history or no candidate (the program accepts both): with one token per
    # user at most, that is how the totals come to differ from the number of users.
    found = None
    for batch, fresh, hist_gap, cand_gap in itertools.product(range(4, EXAMPLE_USERS + 1), (2, 3), (0, 3, 2),
                                                              (0, 5, 4)):
        hist = [0 if hist_gap and i % hist_gap == 0 else min(2 + i % 4, max_hist) for i in range(batch)]
        cand = [0 if cand_gap and i % cand_gap == 0 else min(1 + (3 * i) % 5, max_cand) for i in range(batch)]
        taken = {batch, fresh, sum(hist), sum(cand)}
        if len(taken) == 4 and min(taken) >= 2:
            found = batch, fresh, hist, cand
            break
    if found is None:
        raise ConfigError("--kv-cache: cannot build an example request with distinct sizes for these length ranges; "
                          "raise --max-seq-len or --max-candidates")
    batch, fresh, hist, cand = found
    width = next(n for n in range(2, 64) if n not in taken)
    pages = next(n for n in range(batch + 1, 256) if n not in taken | {width})  # one page per cached user at least
    cached = [0] * fresh + [min(5 + i, max_hist) for i in range(batch - fresh)]  # each within one page
    request = generate_batch(model.input_schema(), batch, seed=seed, lengths={HISTORY_LENGTHS: hist,
                                                                              CANDIDATE_LENGTHS: cand})
    request = {k: v.to(device) for k, v in request.items()}
    with torch.no_grad():
        emb = model.sparse_arch(request)
    cached_t = torch.tensor(cached, dtype=torch.int64)
    gen = torch.Generator().manual_seed(seed)
    shape = (layout.num_layers, pages, page_size, layout.num_heads)
    k = torch.randn(*shape, layout.attention_dim, generator=gen).to(device, layout.dtype)
    v = torch.randn(*shape, layout.linear_dim, generator=gen).to(device, layout.dtype)
    table = torch.zeros(batch, width, dtype=torch.int32)
    table[fresh:, 0] = torch.arange(1, batch - fresh + 1, dtype=torch.int32)  # page b for cached user b
    values = {**emb, **request,
              "contextual_emb": stacked_contextual(emb, layout.contextual_features, cached_t, emb["uih_item_emb"]),
              "kv_cached": cached_t.to(device), "kv_k_pages": k, "kv_v_pages": v, "kv_page_table": table.to(device)}
    return {name: values[name].clone(memory_format=torch.contiguous_format) for name in PROGRAM_INPUTS}


def bucket_steps(ranges: Any) -> tuple[int, int]:
    """(new history tokens, candidates): the multiples a CUDA-graph shape bucket rounds a request's token
    counts up to (``runtimes/kv_graphs.py``; the C++ runtime takes the same)."""
    return min(64, ranges.max_lengths[HISTORY_LENGTHS]), min(32, ranges.max_lengths[CANDIDATE_LENGTHS])


def program_bounds(ranges: Any) -> dict[str, int]:
    """The most users, new history tokens and candidates one call of the delta program takes (its exported
    dims; the manifest's ``kv_cache.bounds``). A call beyond them is outside what the program was compiled
    for: its answers are not defined, so shape buckets (whose padding user adds a user and tokens) must stay
    within them. They leave room for that padding user: one user, and the tokens that round the counts up
    to a bucket (:func:`bucket_steps`), past the package's largest request, so that a request at the
    package's maximum batch still runs in a bucket."""
    b_max = max(ranges.max_batch_size, EXAMPLE_USERS)  # requests are held to the package's maximum by the ranker
    step_h, step_c = bucket_steps(ranges)
    return {"batch": b_max + 1, "new_history": b_max * ranges.max_lengths[HISTORY_LENGTHS] + step_h,
            "candidates": b_max * ranges.max_lengths[CANDIDATE_LENGTHS] + step_c}


def legacy_program_bounds(ranges: Any) -> dict[str, int]:
    """The bounds a package's delta program was exported with before they were recorded in its manifest
    (no room for a padding user)."""
    b_max = max(ranges.max_batch_size, EXAMPLE_USERS)
    return {"batch": b_max, "new_history": max(b_max * ranges.max_lengths[HISTORY_LENGTHS], 5),
            "candidates": max(b_max * ranges.max_lengths[CANDIDATE_LENGTHS], 5)}


def dynamic_shapes(model: HstuRankingModel, ranges: Any, page_size: int,
                   names: list[str]) -> dict[str, dict[int, Any]]:
    """torch.export dims of the delta program's inputs, by name."""
    from torch.export import Dim

    bounds = program_bounds(ranges)
    max_seq_len, _ = kv_bounds(model, ranges)
    batch = Dim("batch", min=1, max=bounds["batch"])
    fresh = Dim("fresh_users", min=0, max=bounds["batch"])
    hist = Dim("new_history", min=0, max=bounds["new_history"])
    cand = Dim("candidates", min=1, max=bounds["candidates"])
    pages = Dim("pages", min=1, max=MAX_PAGES)
    width = Dim("page_table_width", min=1, max=page_table_width_bound(max_seq_len, page_size))
    dims: dict[str, dict[int, Any]] = {
        "uih_item_emb": {0: hist}, "uih_action_emb": {0: hist}, "uih_timestamps": {0: hist},
        "candidate_item_emb": {0: cand}, HISTORY_LENGTHS: {0: batch},
        CANDIDATE_LENGTHS: {0: batch}, "query_time": {0: batch}, "kv_cached": {0: batch}, "kv_k_pages": {1: pages},
        "kv_v_pages": {1: pages}, "kv_page_table": {0: batch, 1: width},
        # [F, contextual features, D]; without contextual features always [0, 0, D]
        "contextual_emb": {0: fresh} if model.config.contextual_seq_len else {},
    }
    return {name: dims.get(name, {}) for name in names}


def compile_kv_delta(model: HstuRankingModel, ranges: Any, settings: Any, op_target: str, out_dir: Path,
                     output_names: list[str]) -> dict[str, Any]:
    """Export and compile the delta program into ``out_dir`` (the package being built); returns the
    manifest's ``kv_cache`` section."""
    device, page_size = settings.torch_device, settings.kv_page_size
    max_seq_len, max_query_len = kv_bounds(model, ranges)
    program = DeltaProgram(model, attention_for(op_target, settings.kv_splits), max_seq_len, max_query_len,
                           attention_inputs_for(op_target), residual_for(op_target), heads_for(model),
                           gated_attention_for(op_target, settings.kv_splits)).eval()
    example = example_inputs(model, ranges, page_size, device, settings.verify.seed)
    names = list(example)
    start = time.perf_counter()
    try:
        with torch.no_grad(), unbacked_ranges_hold_at_one():
            exported = torch.export.export(program, args=(), kwargs=example,
                                           dynamic_shapes=dynamic_shapes(model, ranges, page_size, names), strict=False)
    except Exception as exc:
        text = str(exc).strip().splitlines()
        raise ExportError(f"torch.export of the KV-cache delta program failed: {text[0] if text else type(exc).__name__}"
                          ) from exc
    (out_dir / KV_DELTA_FILE).parent.mkdir(parents=True, exist_ok=True)
    options = delta_inductor_options(device, settings.aoti_options)
    try:
        with unbacked_ranges_hold_at_one(), recording_input_bounds() as bounds:
            torch._inductor.aoti_compile_and_package(exported, package_path=str(out_dir / KV_DELTA_FILE),
                                                     inductor_configs=dict(options))
    except Exception as exc:
        text = str(exc).strip().splitlines()
        raise ExportError(f"AOTInductor compilation of the KV-cache delta program failed: "
                          f"{text[0] if text else type(exc).__name__}") from exc
    refuse_narrowed("KV-cache delta", exported, bounds)
    layout = KVLayout.of(model)
    with torch.no_grad():
        returned = list(program(**example))  # the compiled program returns its outputs in this order
    if sorted(returned) != sorted(output_names):
        raise ExportError(f"the KV-cache delta program returns {returned}, not the model's outputs {output_names}")
    return {
        "program": KV_DELTA_FILE,
        "inputs": names,
        "outputs": returned,
        "page_size": page_size,
        "splits": settings.kv_splits,
        "max_seq_len": max_seq_len,
        "max_query_len": max_query_len,
        "bounds": program_bounds(ranges),
        # The program fits each user's token counts to its tables (models/cached.py's fit_counts): a shape
        # bucket's padding user may be given the bucket's rows, the same on every call.
        "fits_counts": True,
        "layout": {"num_layers": layout.num_layers, "num_heads": layout.num_heads,
                   "attention_dim": layout.attention_dim, "linear_dim": layout.linear_dim,
                   "contextual_features": list(layout.contextual_features),
                   "time_bucket_base": layout.time_bucket_base, "num_time_buckets": layout.num_time_buckets},
        "scaling_seqlen": model.config.attn_scaling_seqlen,
        "inductor_options": options,
        "compile_seconds": round(time.perf_counter() - start, 3),
    }


# -- verification: scripted requests through the package's cache ------------------------------------

class _Histories:
    """Each user's full history and contextual ids (from one generated batch at the maximum lengths);
    a request takes a prefix of each named user's history, and fresh candidates."""

    def __init__(self, schema: Any, layout: KVLayout, users: int, max_hist: int, seed: int) -> None:
        from hstu_export.verification.batch import generate_batch

        self.layout, self.schema, self.seed = layout, schema, seed
        self.full = generate_batch(schema, users, seed=seed, lengths={HISTORY_LENGTHS: [max_hist] * users,
                                                                      CANDIDATE_LENGTHS: [1] * users})
        self.max_hist = max_hist
        self.calls = 0

    def request(self, users: list[int], hist: list[int], cand: list[int]) -> dict[str, Tensor]:
        from hstu_export.verification.batch import generate_batch

        self.calls += 1
        fresh = generate_batch(self.schema, len(users), seed=self.seed + 101 * self.calls,
                               lengths={HISTORY_LENGTHS: [1] * len(users), CANDIDATE_LENGTHS: cand})
        rows = torch.cat([torch.arange(u * self.max_hist, u * self.max_hist + h) for u, h in zip(users, hist)])
        out = dict(fresh)
        for name in HISTORY_TOKEN_FEATURES:
            out[name] = self.full[name][rows]
        out[HISTORY_LENGTHS] = torch.tensor(hist, dtype=self.full[HISTORY_LENGTHS].dtype)
        index = torch.tensor(users)
        for name in (*self.layout.contextual_features, "query_time"):
            out[name] = self.full[name][index]
        return out


def verification_steps(ranges: Any, page_size: int) -> list[tuple[str, list[int], list[int], list[int]]]:
    """(what it checks, users, history lengths, candidates) per request, within the package's ranges."""
    h, max_cand = ranges.max_lengths[HISTORY_LENGTHS], ranges.max_lengths[CANDIDATE_LENGTHS]
    grown = min(h, h // 3 + 1 + page_size)  # more than a page past user 1's first prefix, when the range allows
    steps = [
        ("prefill (every user a miss)", [0, 1, 2], [max(1, h // 2), h // 3 + 1, max(1, h - 1)],
         [max_cand, 1, max(1, max_cand // 2)]),
        ("hit: new candidates only, one new token for user 0", [0, 1, 2], [max(1, h // 2), h // 3 + 1, max(1, h - 1)],
         [1, max_cand, min(2, max_cand)]),
        ("history grown by one token and by more than a page, users reordered", [2, 0, 1],
         [max(1, h - 1), min(h, max(1, h // 2) + 1), grown], [min(2, max_cand), max_cand, 1]),
        ("a new user with cached ones", [3, 0], [max(1, h // 2), min(h, max(1, h // 2) + 1)], [max_cand, min(2, max_cand)]),
    ]
    low_h, low_c = ranges.min_lengths[HISTORY_LENGTHS], ranges.min_lengths[CANDIDATE_LENGTHS]
    return [(what, users, [max(n, low_h) for n in hist], [max(n, low_c) for n in cand])
            for what, users, hist, cand in steps]


def verify_kv_cache(predictor: Any, reference: Callable[[dict[str, Tensor]], dict[str, Tensor]],
                    tolerances: dict[str, float], seed: int) -> dict[str, Any]:
    """Serve :func:`verification_steps` through the package's cache, in order, and compare each answer
    with ``reference`` (the user's model on the whole request). Returns the ``parity.kv_cache`` record:
    ``check_parity``'s, plus the cache's counters; it fails when no request was served from the cache."""
    from hstu_export.verification.parity import check_parity

    section = predictor.manifest["kv_cache"]
    ranker = predictor.kv_cache()
    ranges = predictor.package_manifest.ranges.lengths
    histories = _Histories(predictor.input_schema, ranker.layout, 4, ranges.max_lengths[HISTORY_LENGTHS], seed)
    batches, users_of = [], {}
    for what, users, hist, cand in verification_steps(ranges, section["page_size"]):
        n = min(len(users), predictor.max_batch_size)
        batches.append((what, histories.request(users[:n], hist[:n], cand[:n])))
        users_of[what] = [_user_id(u) for u in users[:n]]
    current: list[str] = []
    report = check_parity(lambda batch: ranker(batch, users_of[current[-1]]), reference, batches, tolerances,
                          on_batch=current.append)
    report["cache"] = ranker.cache.stats()
    if report["cache"]["hits"] == 0:
        report["passed"] = False  # nothing was served from the cache: the delta path went unchecked
    return report


def kv_failure(report: dict[str, Any]) -> str:
    """Why :func:`verify_kv_cache`'s ``report`` failed, in one line."""
    from hstu_export.verification.parity import mismatch_summary

    if all(row["passed"] for row in report["batches"]):
        return "no request was served from the KV cache"
    return mismatch_summary(report)


def _user_id(index: int) -> Hashable:
    return f"verify-user-{index}"
