"""KV-cached serving on the GPU: the cached (delta) path against full recomputation, same run.

    PYTHONPATH=$PWD python benchmarks/kv_cache.py --out $OUT [--batches 1 8 32] [--no-export]

Two workloads on the dlrmv3 shapes (bf16, D=512, 4 heads of 128, 5 layers):
  long  history 4096, 3968 of it cached, 256 candidates: 384 new tokens per user;
  dlrm  history 1024, all cached, 2048 candidates (the dlrmv3 workload): 2048 new tokens per user.
Per workload and batch size:
  1. one layer's attention kernel: full attention over the whole sequence (the no-cache path), the
     older cached kernel (delta queries against gathered full K/V), and the paged split-K kernel;
  2. the whole model per request: the no-cache AOTInductor package (exported here with --kv-cache, unless
     --no-export) and the eager model with Triton kernels, against the eager cached path (DeltaRanker.run
     on a filled cache, and CachedRanker end to end with its cache bookkeeping), and against the package's
     own cached path: its exported delta program alone (vs the package's no-cache dense program) and its
     cached ranker end to end (vs the package end to end).
Writes kv_cache.json (after every step).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e import DenseStack, dense_inputs, set_kernel

import hstu_export
from hstu_export.models.cached import DeltaRanker
from hstu_export.models.config import preset_config
from hstu_export.models.ranking import HstuRankingModel
from hstu_export.ops import Kernel
from hstu_export.ops._triton import cached_hstu_mha_triton_fwd, hstu_mha_triton_fwd
from hstu_export.ops._triton.paged import paged_hstu_mha_triton_fwd
from hstu_export.serving.kv_cache import TOKEN_ROWS, CachedRanker, EntryRecord, token_run, valid_query_times

WORKLOADS = {"long": dict(history=4096, cached=3968, candidates=256), "dlrm": dict(history=1024, cached=1024,
                                                                                   candidates=2048)}
PAGE = 64


def bench(fn, iters: int = 30, warmup: int = 5) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """Median and p99 of whole calls (CUDA events; wall clock on CPU, for the --small check)."""
    cuda = torch.cuda.is_available()
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    samples = []
    for _ in range(iters):
        if not cuda:
            t = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t) * 1e3)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    samples.sort()
    return {"p50_ms": statistics.median(samples), "p99_ms": samples[min(len(samples) - 1, int(0.99 * len(samples)))]}


def bench_graph(fn, iters: int = 50) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """``fn`` captured once in a CUDA graph, replays timed: GPU time with no host launch overhead (what
    CUDA graphs give the small-batch path). Errors (a sync inside fn) are recorded, not raised."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return bench(graph.replay, iters)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:500]}


def kernels(work: dict, batch: int, device: torch.device) -> dict:
    """One layer's attention, three ways, on random bf16 q/k/v."""
    h, d, dtype = 4, (16 if device.type == "cpu" else 128), torch.bfloat16
    hist, cached, cand = work["history"], work["cached"], work["candidates"]
    n = hist + cand
    new = n - cached
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(batch * n, h, d, device=device, dtype=dtype, generator=gen) for _ in range(3))
    offsets = torch.arange(batch + 1, device=device) * n
    targets = torch.full((batch,), cand, device=device)
    scale, alpha = n, 1 / d**0.5
    rows = (offsets[:-1].unsqueeze(1) + torch.arange(cached, n, device=device)).flatten()
    out: dict = {}
    out["full"] = bench(lambda: hstu_mha_triton_fwd(q, k, v, offsets, n, scale, alpha, True, targets, 0, 0))
    dq = q[rows].contiguous()
    out["cached_gathered"] = bench(lambda: cached_hstu_mha_triton_fwd(dq, k, v, offsets, new, n, scale, alpha, targets,
                                                                      0, 0))
    # Pages: each user's first `cached` tokens, in shuffled pages.
    per_user = -(-cached // PAGE)
    order = torch.randperm(batch * per_user, device=device, generator=gen).to(torch.int32)
    table = order.reshape(batch, per_user)
    k_pages = torch.zeros(batch * per_user, PAGE, h, d, device=device, dtype=dtype)
    v_pages = torch.zeros_like(k_pages)
    tok = torch.arange(cached, device=device)
    for b in range(batch):
        src = b * n + tok
        slots = table[b].to(torch.int64)[tok // PAGE] * PAGE + tok % PAGE
        k_pages.view(-1, h, d)[slots] = k[src]
        v_pages.view(-1, h, d)[slots] = v[src]
    kn, vn = k[rows].contiguous(), v[rows].contiguous()
    q_offsets = torch.arange(batch + 1, device=device) * new
    seq_lens = torch.full((batch,), n, device=device)

    def paged():  # type: ignore[no-untyped-def]
        return paged_hstu_mha_triton_fwd(dq, kn, vn, q_offsets, k_pages, v_pages, table, seq_lens, targets, scale,
                                         alpha, 0, 0, max_seq_len=n, max_query_len=new)

    out["paged_split"] = bench(paged)
    if device.type == "cuda":
        full = lambda: hstu_mha_triton_fwd(q, k, v, offsets, n, scale, alpha, True, targets, 0, 0)  # noqa: E731
        out["graph_full"] = bench_graph(full)
        out["graph_cached_gathered"] = bench_graph(
            lambda: cached_hstu_mha_triton_fwd(dq, k, v, offsets, new, n, scale, alpha, targets, 0, 0))
        out["graph_paged_split"] = bench_graph(paged)
        out["graph_paged_no_prefetch"] = bench_graph(functools.partial(  # page numbers read in the block's turn
            paged_hstu_mha_triton_fwd, dq, kn, vn, q_offsets, k_pages, v_pages, table, seq_lens, targets, scale, alpha,
            0, 0, max_seq_len=n, max_query_len=new, prefetch_pages=False))
        for page in (128, 256):  # larger pages: fewer page-table reads per key (shuffled, as the others)
            per = -(-cached // page)
            big_table = torch.randperm(batch * per, device=device, generator=gen).to(torch.int32).reshape(batch, per)
            big_k = torch.zeros(batch * per, page, h, d, device=device, dtype=dtype)
            big_v = torch.zeros_like(big_k)
            out[f"graph_paged_page_{page}"] = bench_graph(
                lambda big_k=big_k, big_v=big_v, big_table=big_table: paged_hstu_mha_triton_fwd(
                    dq, kn, vn, q_offsets, big_k, big_v, big_table, seq_lens, targets, scale, alpha, 0, 0,
                    max_seq_len=n, max_query_len=new))
        for one in (1, 2, 4, 8):  # the key-split count forced
            out[f"graph_paged_splits_{one}"] = bench_graph(
                lambda one=one: paged_hstu_mha_triton_fwd(dq, kn, vn, q_offsets, k_pages, v_pages, table, seq_lens,
                                                          targets, scale, alpha, 0, 0, max_seq_len=n,
                                                          max_query_len=new, splits=one))
    reference = hstu_mha_triton_fwd(q, k, v, offsets, n, scale, alpha, True, targets, 0, 0)[rows].float()
    got = paged().float()
    out["paged_rel_err_vs_full"] = float((got - reference).norm() / reference.norm())
    out["full_over_paged"] = out["full"]["p50_ms"] / out["paged_split"]["p50_ms"]
    out["cached_gathered_over_paged"] = out["cached_gathered"]["p50_ms"] / out["paged_split"]["p50_ms"]
    if "p50_ms" in out.get("graph_paged_split", {}):
        for base in ("graph_full", "graph_cached_gathered"):
            if "p50_ms" in out[base]:
                out[f"{base}_over_graph_paged"] = out[base]["p50_ms"] / out["graph_paged_split"]["p50_ms"]
    return out


def sweep(work: dict, batches: list[int], device: torch.device) -> dict:
    """The paged kernel under each candidate tile shape (CUDA graph replays, slices chosen per call), on
    the same shapes as :func:`kernels`: which config the table should hold for it."""
    return {batch: _sweep_batch(work, batch, device) for batch in batches}


def _sweep_batch(work: dict, batch: int, device: torch.device) -> dict:
    from hstu_export.ops._triton.configs import AttentionConfig

    h, d, dtype = 4, 128, torch.bfloat16
    cached, n = work["cached"], work["history"] + work["candidates"]
    new = n - cached
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(batch * new, h, d, device=device, dtype=dtype, generator=gen) for _ in range(3))
    per_user = -(-cached // PAGE)
    table = torch.randperm(batch * per_user, device=device, generator=gen).to(torch.int32).reshape(batch, per_user)
    k_pages, v_pages = (torch.randn(batch * per_user, PAGE, h, d, device=device, dtype=dtype, generator=gen)
                        for _ in range(2))
    q_offsets = torch.arange(batch + 1, device=device) * new
    seq_lens = torch.full((batch,), n, device=device)
    targets = torch.full((batch,), work["candidates"], device=device)
    row: dict = {}
    reference = None
    for bm, bn, warps, stages in itertools.product((32, 64, 128), (32, 64), (4, 8), (2, 3, 4)):
        cfg = AttentionConfig(block_m=bm, block_n=bn, num_warps=warps, num_stages=stages)
        call = functools.partial(paged_hstu_mha_triton_fwd, q, k, v, q_offsets, k_pages, v_pages, table, seq_lens,
                                 targets, n, 1 / d**0.5, 0, 0, max_seq_len=n, max_query_len=new, config=cfg)
        name = f"{bm}x{bn}_w{warps}_s{stages}"
        try:
            got = call().float()
            reference = got if reference is None else reference
            row[name] = {**bench_graph(call), "rel_err": float((got - reference).norm() / reference.norm())}
        except Exception as exc:  # out of shared memory, say: recorded
            row[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    timed = {name: r["p50_ms"] for name, r in row.items() if "p50_ms" in r}
    row["best"] = min(timed, key=timed.__getitem__) if timed else None
    return row


def kernel_trace(runner, inputs: dict, path: Path, calls: int = 10) -> dict:  # type: ignore[no-untyped-def]
    """The delta program's CUDA kernels per call (torch.profiler), and its host time per call against its
    GPU time: how launch-bound it is. The table goes to ``path``."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        runner.run_program(inputs, bucketed=False)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        runner.run_program(inputs, bucketed=False)
    host_ms = (time.perf_counter() - t) * 1e3 / calls  # launches only: no sync inside the loop
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            runner.run_program(inputs, bucketed=False)
        torch.cuda.synchronize()
    events = prof.key_averages()
    path.write_text(events.table(sort_by="cuda_time_total", row_limit=80, max_name_column_width=90))
    gpu = [e for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
    return {"host_ms_per_call": host_ms, "kernels_per_call": sum(e.count for e in gpu) / calls,
            "gpu_ms_per_call": sum(e.device_time_total for e in gpu) / calls / 1e3}


def served_ab(runner, inputs: dict, scratch: int, rounds: int = 3) -> dict:  # type: ignore[no-untyped-def]
    """Same run, as served: graphs that copy the request in themselves (their copy nodes pointed at each
    request's tensors: runtimes/graph_copies.py) against graphs whose requests are copied before each replay.
    Each variant captures its own graphs; rounds alternate. The page table is built at its bucket's width, as
    the ranker builds it. Then each variant serves the request in new tensors (new addresses: the nodes are
    pointed anew) and their outputs are compared bit for bit."""
    from hstu_export.runtimes.kv_graphs import STATIC_INPUTS, GraphCache

    table = inputs["kv_page_table"]
    wide = runner.table_width(table.shape[1])
    inputs = {**inputs, "kv_page_table": torch.nn.functional.pad(table, (0, wide - table.shape[1]), value=scratch)}
    kept = runner.graphs
    variants = {name: GraphCache(runner._run, runner._buckets, runner.layout.contextual_seq_len, copy_nodes=nodes)
                for name, nodes in (("copies_before", False), ("copy_nodes", True))}
    p50: dict[str, list[float]] = {name: [] for name in variants}
    outputs = {}
    try:
        for _ in range(rounds):
            for name, graphs in variants.items():
                runner.graphs = graphs
                p50[name].append(bench(lambda: runner.run_program(inputs), iters=30)["p50_ms"])
        for name, graphs in variants.items():
            runner.graphs = graphs
            moved = {key: value if key in STATIC_INPUTS else value.clone() for key, value in inputs.items()}
            outputs[name] = runner.run_program(moved)
    finally:
        runner.graphs = kept
    median = {name: statistics.median(values) for name, values in p50.items()}
    return {"p50_ms_rounds": p50, "p50_ms": median, "before_over_nodes": median["copies_before"] / median["copy_nodes"],
            "outputs_equal": all(torch.equal(outputs["copy_nodes"][k], outputs["copies_before"][k])
                                 for k in outputs["copies_before"]),
            "counts": {name: dict(graphs.counts) for name, graphs in variants.items()}}


def served_steps(graphs, inputs: dict, iters: int = 50) -> dict:  # type: ignore[no-untyped-def]
    """Host time of each step of a served call (ms, medians), the request's bucket already captured: its key,
    the copies into its buffers (or the pointing of the graph's copy nodes), the graph's launch, the copies of
    the outputs. Synchronised between calls (outside the timings), so that the GPU is idle when each starts,
    as in the timed served calls."""
    from hstu_export.runtimes.kv_graphs import bucket_key, first_rows, unpad

    key = bucket_key(inputs, graphs._buckets, graphs._contextual)
    if key is None:
        return {"error": "the request has no bucket within the delta program's bounds (it runs without a graph)"}
    entry = graphs._graphs[key]
    steps: dict[str, list[float]] = {"key": [], "fill": [], "replay": [], "outputs": []}
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        bucket_key(inputs, graphs._buckets, graphs._contextual)
        t1 = time.perf_counter()
        # The graph's copy nodes pointed at the request's tensors, or the request copied before the replay.
        candidates = graphs._point(entry, inputs) if entry.graph_copies is not None else graphs._fill(entry, inputs)
        t2 = time.perf_counter()
        entry.graph.replay()
        t3 = time.perf_counter()
        first_rows(unpad(entry.outputs, candidates))
        t4 = time.perf_counter()
        for name, a, b in (("key", t0, t1), ("fill", t1, t2), ("replay", t2, t3), ("outputs", t3, t4)):
            steps[name].append((b - a) * 1e3)
    torch.cuda.synchronize()
    return {name: statistics.median(values) for name, values in steps.items()}


def served_trace(runner, inputs: dict, path: Path, calls: int = 10) -> dict:  # type: ignore[no-untyped-def]
    """torch.profiler over served calls (CUDA graph replays): the host-side operations and their CPU time,
    to ``path``; returns the GPU's busy time and its kernels per call (the graph's, the copies' and the
    outputs')."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        runner.run_program(inputs)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            runner.run_program(inputs)
            torch.cuda.synchronize()
    events = prof.key_averages()
    path.write_text(events.table(sort_by="cpu_time_total", row_limit=60, max_name_column_width=90))
    gpu = [e for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
    return {"gpu_ms_per_call": sum(e.device_time_total for e in gpu) / calls / 1e3,
            "kernels_per_call": sum(e.count for e in gpu) / calls, "timeline": gpu_timeline(prof.events())}


def gpu_timeline(events, split_us: float = 20.0) -> dict:  # type: ignore[no-untyped-def]
    """Where a call's GPU time goes, from the profiler's device events: calls are told apart by an idle gap of
    more than ``split_us`` (the host synchronises between them: 87-95 us on the H100 at 1 user, where a call's own
    gaps were under 2 us; at 100 us four 1-user calls run together). Per call (medians): the
    span from the first kernel's start to the last one's end, the time some kernel runs, the idle time between
    them, and the five longest idle gaps with the kernel that follows each; and the median call's operations in
    order."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                   if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA)
    calls: list[list[tuple[float, float, str]]] = []
    reached = float("-inf")  # the latest end so far
    for start, end, name in spans:
        if start - reached > split_us:
            calls.append([])
        calls[-1].append((start, end, name))
        reached = max(reached, end)
    rows = []
    for call in calls:
        busy, reach, gaps = 0.0, call[0][0], []
        for start, end, name in call:
            if start > reach:
                gaps.append((start - reach, name))
            busy += max(0.0, end - max(start, reach))
            reach = max(reach, end)
        rows.append({"span": reach - call[0][0], "busy": busy, "kernels": len(call),
                     "gaps": sorted(gaps, reverse=True)[:5],
                     "order": [(n[:60], round(s - call[0][0], 2), round(e - s, 2)) for s, e, n in call]})
    if not rows:
        return {}
    mid = sorted(rows, key=lambda r: r["span"])[len(rows) // 2]
    return {"calls": len(rows), "span_us": statistics.median(r["span"] for r in rows),
            "busy_us": statistics.median(r["busy"] for r in rows),
            "idle_us": statistics.median(r["span"] - r["busy"] for r in rows),
            "kernels": mid["kernels"], "longest_gaps_of_median_call": [(round(g, 1), n[:80]) for g, n in mid["gaps"]],
            # The median call's kernels in order: (name, start from the call's first kernel, duration), µs.
            "median_call_kernels": mid["order"]}


def failure(exc: Exception, tail: int = 2000) -> dict:
    """A step's error, recorded in the results so that the other steps still run (``tail``: characters of
    the traceback kept)."""
    return {"error": f"{type(exc).__name__}: {exc}"[:1500], "traceback": traceback.format_exc()[-tail:]}


def request(model: HstuRankingModel, work: dict, batch: int, seed: int) -> dict[str, torch.Tensor]:
    lengths = {"uih_lengths": [work["history"]] * batch, "candidate_lengths": [work["candidates"]] * batch}
    return hstu_export.generate_batch(model.input_schema(), batch, seed=seed, lengths=lengths)


def prefix_record(host: dict, work: dict, b: int, layout) -> EntryRecord:  # type: ignore[no-untyped-def]
    """What the cache records for user ``b``'s first ``cached`` history tokens (no contextual features)."""
    rows = slice(b * work["history"], b * work["history"] + work["cached"])
    events = [host[name][rows].to(torch.int64) for name in TOKEN_ROWS]
    now = int(host["query_time"][b])
    stamps = events[TOKEN_ROWS.index("uih_timestamps")]
    lo, hi = valid_query_times(stamps, torch.full_like(stamps, now), torch.zeros_like(stamps), 1, layout)
    return EntryRecord(np.empty(0, dtype=np.int64), (token_run([e.numpy() for e in events]),), now, (lo[0], hi[0]))


def model_row(gpu: HstuRankingModel, model: HstuRankingModel, package, work: dict, batch: int,  # type: ignore[no-untyped-def]
              device: torch.device, profile_dir: Path | None = None, trace_dir: Path | None = None) -> dict:
    """The whole model per request: no-cache baselines against the cached path, on one batch."""
    cfg = gpu.config
    delta = DeltaRanker(gpu)
    row: dict = {}
    features = {k: v.to(device) for k, v in request(model, work, batch, 100 + batch).items()}
    with torch.no_grad():
        full = gpu(features)
        row["eager_full"] = bench(lambda: gpu(features), iters=20)
        if package is not None:
            row["package_full"] = bench(lambda: package(features), iters=20)
            split = package.split
            package_inputs = split.dense_inputs(features)
            row["package_dense"] = bench(lambda: split.dense(**package_inputs), iters=20)
        per_token = cfg.num_layers * cfg.num_heads * (cfg.attention_dim + cfg.linear_dim) * 2
        ranker = CachedRanker(gpu, budget_bytes=batch * (work["history"] + PAGE) * per_token + (1 << 20),
                              page_size=PAGE)
        users = list(range(batch))
        prefix = {**features}
        if work["cached"] < work["history"]:  # fill the cache with the first `cached` tokens
            keep = torch.cat([torch.arange(b * work["history"], b * work["history"] + work["cached"],
                                           device=device) for b in range(batch)])
            for key in ("uih_item_ids", "uih_action_ids", "uih_timestamps"):
                prefix[key] = features[key][keep]
            prefix["uih_lengths"] = torch.full_like(features["uih_lengths"], work["cached"])
        ranker(prefix, users)
        got = ranker(features, users)  # a hit
        row["cache_stats"] = ranker.cache.stats()
        row["cache_bytes"] = ranker.cache.bytes
        row["rel_err_cached_vs_full"] = max(float((got[k].float() - full[k].float()).norm()
                                                  / full[k].float().norm()) for k in full)
        # The delta alone, on the filled cache (what an exported delta program would run).
        table = torch.tensor([ranker.cache.entry(u).pages for u in users], dtype=torch.int32,
                             device=device)
        cached = torch.full((batch,), work["cached"], dtype=torch.int64)
        # The delta request: each user's history after the cached prefix.
        fresh = torch.cat([torch.arange(b * work["history"] + work["cached"], (b + 1) * work["history"],
                                        device=device) for b in range(batch)])
        delta_features = {**features, "uih_lengths": torch.full_like(features["uih_lengths"],
                                                                     work["history"] - work["cached"])}
        for key in ("uih_item_ids", "uih_action_ids", "uih_timestamps"):
            delta_features[key] = features[key][fresh]
        row["delta_run"] = bench(lambda: delta.run(delta_features, cached, ranker.cache.k, ranker.cache.v,
                                                   table), iters=20)
        if device.type == "cuda":
            # CUDA graphs: the dense delta (embeddings and plan made once) and the full eager dense half.
            emb = gpu.sparse_arch(delta_features)
            plan = delta.plan(delta_features, cached, device)
            row["graph_delta_dense"] = bench_graph(lambda: delta.dense(emb, delta_features, plan, ranker.cache.k,
                                                                       ranker.cache.v, table))
            stack = DenseStack(gpu)
            inputs = dense_inputs(gpu, features, device, torch.bfloat16)
            row["graph_full_dense"] = bench_graph(lambda: stack(**inputs))
            row["eager_full_dense"] = bench(lambda: stack(**inputs), iters=20)
            if "p50_ms" in row["graph_delta_dense"]:
                for base in ("graph_full_dense", "eager_full_dense"):
                    if "p50_ms" in row[base]:
                        row[f"{base}_over_graph_delta_dense"] = row[base]["p50_ms"] / row["graph_delta_dense"]["p50_ms"]
                if package is not None:
                    row["package_dense_over_graph_delta_dense"] = row["package_dense"]["p50_ms"] / \
                        row["graph_delta_dense"]["p50_ms"]
        ran = delta.run(delta_features, cached, ranker.cache.k, ranker.cache.v, table)
        row["rel_err_delta_run_vs_full"] = max(float((ran[k].float() - full[k].float()).norm()
                                                     / full[k].float().norm()) for k in full)
        host = {k: v.cpu() for k, v in features.items()}

        prefix_state = {}  # each user's entry at `cached` tokens, computed once (not part of what is timed)
        for b in users:
            prefix_state[b] = prefix_record(host, work, b, ranker.layout)

        def reset_and_run(ranker=ranker, request=features):  # type: ignore[no-untyped-def]
            # Put each user back to `cached` tokens (bookkeeping only: a dict update each), then serve.
            for b in users:
                ranker.cache.commit(b, work["cached"], prefix_state[b])
            return ranker(request, users)

        row["cached_ranker"] = bench(reset_and_run, iters=20)
        if package is not None and "kv_cache" in package.manifest:
            package_row(row, package, ranker.cache.bytes, prefix, features, full, work, batch, device, reset_and_run,
                        profile_dir, trace_dir)
        for base in ("eager_full", "package_full"):
            if base in row:
                row[f"{base}_over_delta_run"] = row[base]["p50_ms"] / row["delta_run"]["p50_ms"]
                row[f"{base}_over_cached_ranker"] = row[base]["p50_ms"] / row["cached_ranker"]["p50_ms"]
        row["users_per_s_cached_ranker"] = batch / (row["cached_ranker"]["p50_ms"] / 1e3)
    return row


def package_row(row: dict, package, budget: int, prefix: dict, features: dict, full: dict, work: dict,  # type: ignore[no-untyped-def]
                batch: int, device: torch.device, reset_and_run, profile_dir: Path | None = None,
                trace_dir: Path | None = None) -> None:
    """The package's own KV-cached path (``--kv-cache``): its delta program alone on a filled cache
    against the package's no-cache dense program, and its cached ranker end to end against the
    package end to end."""
    kv = package.kv_cache(budget_bytes=budget)  # CUDA graphs on CUDA (the default)
    users = list(range(batch))
    kv(prefix, users)
    got = kv(features, users)  # a hit
    row["kv_package_stats"] = kv.cache.stats()
    row["rel_err_kv_package_vs_full"] = max(float((got[k].float() - full[k].float()).norm() / full[k].float().norm())
                                            for k in full)
    table = torch.tensor([kv.cache.entry(u).pages for u in users], dtype=torch.int32, device=device)
    cached = torch.full((batch,), work["cached"], dtype=torch.int64)
    fresh = torch.cat([torch.arange(b * work["history"] + work["cached"], (b + 1) * work["history"], device=device)
                       for b in range(batch)])
    delta_features = {**features, "uih_lengths": torch.full_like(features["uih_lengths"],
                                                                 work["history"] - work["cached"])}
    for key in ("uih_item_ids", "uih_action_ids", "uih_timestamps"):
        delta_features[key] = features[key][fresh]
    runner = kv.runner
    inputs = runner.program_inputs(delta_features, cached, kv.cache.k, kv.cache.v, table)
    row["kv_program"] = bench(lambda: runner.run_program(inputs, bucketed=False), iters=30)
    row["kv_program_graph"] = bench_graph(lambda: runner.run_program(inputs, bucketed=False))
    if trace_dir is not None and device.type == "cuda":
        row["kv_program_trace"] = kernel_trace(runner, inputs, trace_dir / f"kv_kernels_{work['history']}_{batch}.txt")
        dense_inputs_ = package.split.dense_inputs(features)
        row["package_dense_trace"] = kernel_trace(_DenseRunner(package.split, dense_inputs_), {},
                                                  trace_dir / f"dense_kernels_{work['history']}_{batch}.txt")
    if runner.graphs is not None:
        # As served: padded to its shape bucket and replayed from the bucket's CUDA graph.
        row["kv_program_served"] = bench(lambda: runner.run_program(inputs), iters=30)
        t = time.perf_counter()
        for _ in range(10):  # host time per served call (no sync inside the loop)
            runner.run_program(inputs)
        row["kv_program_served_host_ms"] = (time.perf_counter() - t) * 1e2
        torch.cuda.synchronize()
        row["kv_program_served_host_steps"] = served_steps(runner.graphs, inputs)
        if trace_dir is not None:
            row["kv_program_served_trace"] = served_trace(runner, inputs, trace_dir / f"kv_served_{work['history']}_{batch}.txt")
        # Both runs write the new tokens' K/V into their pages: cleared before each, compared after.
        at = new_token_slots(table, work)
        kv.cache.k[:, at[0], at[1]] = 0
        eager_out = runner.run_program(inputs, bucketed=False)
        eager_k = kv.cache.k[:, at[0], at[1]].clone()
        kv.cache.k[:, at[0], at[1]] = 0
        served_out = runner.run_program(inputs)
        row["rel_err_served_vs_eager_program"] = max(
            float((served_out[k].float() - eager_out[k].float()).norm() / eager_out[k].float().norm())
            for k in eager_out)
        row["kv_new_k_equal_served_vs_eager"] = bool(torch.equal(kv.cache.k[:, at[0], at[1]], eager_k))
        row["kv_new_k_written"] = bool(eager_k.ne(0).any())
        row["graph_counts"] = dict(runner.graphs.counts)
        row["kv_program_served_ab"] = served_ab(runner, inputs, kv.cache.scratch_page)
    row["kv_program_inputs"] = bench(lambda: runner.program_inputs(delta_features, cached, kv.cache.k, kv.cache.v,
                                                                   table), iters=20)
    row["kv_package_ranker"] = bench(lambda: reset_and_run(kv), iters=20)
    # Requests as they arrive from a client: on the host. The package then copies the whole request to the
    # GPU; the cached path only each user's new tokens (and compares the rest on the host).
    on_host = {name: value.cpu() for name, value in features.items()}
    row["package_full_host_request"] = bench(lambda: package(on_host), iters=20)
    row["kv_package_ranker_host_request"] = bench(lambda: reset_and_run(kv, on_host), iters=20)
    row["kv_ranker_phases_host_request"] = ranker_phases(kv, on_host, lambda: reset_and_run(kv, on_host))
    if runner.graphs is not None:  # the same requests with the program run eagerly
        graphs, runner.graphs = runner.graphs, None
        row["kv_package_ranker_no_graphs"] = bench(lambda: reset_and_run(kv), iters=20)
        runner.graphs = graphs
    if profile_dir is not None:  # where the host time of a whole cached request goes
        import cProfile
        import io
        import pstats

        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(20):
            reset_and_run(kv)
        if device.type == "cuda":
            torch.cuda.synchronize()
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(45)
        (profile_dir / f"kv_profile_{work['history']}_{batch}.txt").write_text(text.getvalue())
    ratios = {"package_dense_over_kv_program": ("package_dense", "kv_program"),
              "package_dense_over_kv_program_served": ("package_dense", "kv_program_served"),
              "package_dense_over_kv_program_graph": ("package_dense", "kv_program_graph"),
              "package_full_over_kv_package_ranker": ("package_full", "kv_package_ranker"),
              "package_full_over_kv_package_ranker_no_graphs": ("package_full", "kv_package_ranker_no_graphs"),
              "package_full_over_kv_package_ranker_host_request": ("package_full_host_request",
                                                                   "kv_package_ranker_host_request")}
    for name, (base, new) in ratios.items():
        if "p50_ms" in row.get(base, {}) and "p50_ms" in row.get(new, {}):
            row[name] = row[base]["p50_ms"] / row[new]["p50_ms"]
    row["users_per_s_kv_package_ranker"] = batch / (row["kv_package_ranker"]["p50_ms"] / 1e3)


def new_token_slots(table: torch.Tensor, work: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(page, slot) of every user's history tokens past the cached prefix, by the page table."""
    positions = torch.arange(work["cached"], work["history"], device=table.device)
    page = table.long()[:, positions // PAGE].flatten()
    return page, (positions % PAGE).repeat(table.shape[0])


def ranker_phases(kv, request: dict, call, iters: int = 20) -> dict:  # type: ignore[no-untyped-def]
    """Host milliseconds of a whole cached request's phases (each call synchronised): validation; the
    cache's bookkeeping (the runner replaced by one that returns at once); the runner's input preparation
    (sparse half included) and its program, on the delta request the ranker made."""
    runner = kv.runner
    seen: dict = {}

    class Recorder:  # validates as the runner does; keeps the delta request instead of running it
        validate = runner.validate
        table_width = runner.table_width

        def __call__(self, features, cached, k, v, table):  # type: ignore[no-untyped-def]
            seen.update(features=features, cached=cached, table=table)
            return {}

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

    def timed(fn) -> float:  # type: ignore[no-untyped-def]
        fn()
        sync()
        t = time.perf_counter()
        for _ in range(iters):
            fn()
            sync()
        return (time.perf_counter() - t) * 1e3 / iters

    out = {"validate": timed(lambda: runner.validate(request))}
    kv.runner = Recorder()
    try:
        out["bookkeeping_with_validate"] = timed(call)
    finally:
        kv.runner = runner
    args = (seen["features"], seen["cached"], kv.cache.k, kv.cache.v, seen["table"])
    out["program_inputs"] = timed(lambda: runner.program_inputs(*args))
    inputs = runner.program_inputs(*args)
    out["run_program"] = timed(lambda: runner.run_program(inputs))
    out["whole"] = timed(call)
    return out


class _DenseRunner:
    """The no-cache dense program in :func:`kernel_trace`'s calling convention."""

    def __init__(self, split, inputs: dict) -> None:  # type: ignore[no-untyped-def]
        self.split, self.inputs = split, inputs

    def run_program(self, _inputs: dict, bucketed: bool = False):  # type: ignore[no-untyped-def]
        return self.split.dense(**self.inputs)


def save_wrappers(package_root: Path, out: Path, name: str) -> None:
    """The AOTInductor wrapper sources (C++) of the package's programs, to read what each call launches."""
    import zipfile

    for pt2 in package_root.rglob("*.pt2"):
        with zipfile.ZipFile(pt2) as archive:
            for member in archive.namelist():
                if member.endswith(".wrapper.cpp"):
                    (out / f"{name}_{pt2.stem}.wrapper.cpp").write_bytes(archive.read(member))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS))
    parser.add_argument("--no-export", action="store_true")
    parser.add_argument("--kv-splits", type=int, default=0,
                        help="key slices of the exported delta program's kernel (0: chosen per call)")
    parser.add_argument("--sweep", action="store_true", help="time the paged kernel under each candidate tile shape")
    parser.add_argument("--trace", action="store_true",
                        help="profile the programs' kernels per call and keep their AOTInductor wrapper sources")
    parser.add_argument("--kernels-only", action="store_true", help="time the attention kernels only")
    parser.add_argument("--no-kernels", action="store_true", help="skip the attention kernels (time the models only)")
    parser.add_argument("--profile", action="store_true", help="write a cProfile of the package's cached requests")
    parser.add_argument("--small", action="store_true",
                        help="small shapes on CPU (Triton interpreter): checks that the script runs, times nothing")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cpu" if args.small else "cuda")
    if args.small:
        WORKLOADS.update(long=dict(history=150, cached=130, candidates=12), dlrm=dict(history=40, cached=40,
                                                                                         candidates=70))
    report: dict = {"gpu": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
                    "page_size": PAGE, "workloads": {}}

    def save() -> None:
        (args.out / "kv_cache.json").write_text(json.dumps(report, indent=2))

    for name in args.workloads:
        work = WORKLOADS[name]
        entry: dict = {"shape": work, "kernels": {}, "model": {}}
        report["workloads"][name] = entry
        if args.sweep and device.type == "cuda":
            entry["sweep"] = sweep(work, args.batches, device)
            save()
        for batch in ([] if args.no_kernels else args.batches):
            try:
                entry["kernels"][batch] = kernels(work, batch, device)
            except Exception as exc:  # recorded; the rest still runs
                entry["kernels"][batch] = failure(exc)
            save()
        if args.kernels_only:
            continue
        try:
            cfg = dataclasses.replace(preset_config("dlrmv3"), max_history_len=work["history"],
                                      max_num_candidates=work["candidates"])
            if args.small:
                cfg = dataclasses.replace(cfg, embedding_dim=32, attention_dim=16, linear_dim=16, num_layers=2,
                                          item_vocab_size=1000, task_hidden_dims=(16,))
            torch.manual_seed(0)
            model = HstuRankingModel(cfg).eval()
            package = None
            if not args.no_export:
                root = Path(tempfile.mkdtemp(prefix="kv-"))
                bundle = hstu_export.save_bundle(model, root / "m.pt", request(model, work, 2, 1))
                settings = hstu_export.ExportSettings(backend="aoti", device=device.type, dtype="bf16",
                                                      op_target="triton" if device.type == "cuda" else "aten",
                                                      max_batch_size=max(args.batches), kv_cache=True,
                                                      kv_page_size=PAGE, kv_splits=args.kv_splits,
                                                      verify=hstu_export.VerifySettings(num_random_batches=1))
                t = time.perf_counter()
                result = hstu_export.export(bundle, root / "m.aoti", settings)
                entry["export_seconds"] = round(time.perf_counter() - t, 1)
                package = hstu_export.load(result.path)
                entry["kv_export_check"] = result.manifest["parity"].get("kv_cache", {}).get("worst")
                entry["kv_compile_seconds"] = result.manifest.get("kv_cache", {}).get("compile_seconds")
                if args.trace:
                    save_wrappers(Path(result.path), args.out, name)
            gpu = HstuRankingModel(cfg)
            gpu.load_state_dict(model.state_dict())
            gpu = gpu.to(device=device, dtype=torch.bfloat16).eval()
            # Embedding tables stay fp32 as the exported sparse half keeps them; the dense half is bf16.
            gpu.sparse_arch.float()
            set_kernel(gpu, Kernel.TRITON)
            for batch in args.batches:
                entry["model"][batch] = model_row(gpu, model, package, work, batch, device,
                                                  args.out if args.profile else None, args.out if args.trace else None)
                save()
                torch.cuda.empty_cache()
        except Exception as exc:
            entry["model_error"] = f"{type(exc).__name__}: {exc}"[:1500]
            entry["traceback"] = traceback.format_exc()[-3000:]
        save()


if __name__ == "__main__":
    main()
