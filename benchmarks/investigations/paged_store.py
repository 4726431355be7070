"""Variants of the paged attention kernel (hstu_export/ops/_triton/paged.py) timed against each other and
against the kernel without its store of the new K/V, one layer, same run.

    PYTHONPATH=$PWD python benchmarks/investigations/paged_store.py --out $OUT --variant end=FILE [--variant last=FILE ...]
    PYTHONPATH=$PWD python benchmarks/investigations/paged_store.py --report --variant end=FILE ...   # sm_90 resources, no GPU

A variant is a copy of paged.py (its kernels only: the file is read up to its ``@triton_op``, so that no op is
registered twice). Per workload (benchmarks/kv_cache.py's: long, 384 new rows a user against 3968 cached keys;
dlrm, 2048 candidates against 1024) and batch, each variant's launch with ``layer`` (the store on) is captured
in a CUDA graph and its replays timed (p50 of 50, three rounds, the variants in turn), and so is the first
variant's launch without the store. Checks: whether every variant's output equals the first's bit for bit, its
relative L2 error against the layer computed in fp32 (PyTorch, inputs upcast), and whether the pools it leaves
equal the first's (the rows it stores).
Writes paged_store.json.
"""

from __future__ import annotations

import argparse
import json
import linecache
import statistics
import sys
import time
import types
from pathlib import Path

import torch

# kv_cache (and e2e, which it imports) are benchmarks/ scripts; kernel_report sits beside this one.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from kv_cache import PAGE, WORKLOADS, bench_graph


def load_variant(name: str, path: Path) -> types.ModuleType:
    """The kernels of a copy of paged.py, as a module of the package it belongs to (its relative imports)."""
    text = path.read_text()
    text = text[: text.index("@triton_op(")] if "@triton_op(" in text else text
    module = types.ModuleType(f"hstu_export.ops._triton._variant_{name}")
    module.__package__ = "hstu_export.ops._triton"
    module.__file__ = str(path)
    sys.modules[module.__name__] = module  # triton reads the source of the module its kernels come from
    linecache.cache[str(path)] = (len(text), None, text.splitlines(True), str(path))
    exec(compile(text, str(path), "exec"), module.__dict__)
    return module


def case(work: dict, batch: int, device: torch.device) -> dict:
    """One layer's delta request: q/k/v of the new rows; a pool of 2 layers of random K/V (the call reads and
    writes layer 1), with pages enough for each user's cached and new history tokens, shuffled in its table,
    and the scratch page last."""
    h, d, dtype = 4, 128, torch.bfloat16
    cached, n, cand = work["cached"], work["history"] + work["candidates"], work["candidates"]
    new = n - cached
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(batch * new, h, d, device=device, dtype=dtype, generator=gen) for _ in range(3))
    kept = work["history"]  # cached + new history: what a user's pages hold after the call
    per_user = -(-kept // PAGE)
    table = torch.randperm(batch * per_user, device=device, generator=gen).to(torch.int32).reshape(batch, per_user)
    pool = torch.randn(2, batch * per_user + 1, PAGE, h, d, device=device, dtype=dtype, generator=gen)
    return {"args": (q, k, v, torch.arange(batch + 1, device=device) * new, pool, pool.clone(), table,
                     torch.full((batch,), n, device=device), torch.full((batch,), cand, device=device), n,
                     1 / d**0.5, 0, 0), "max_seq_len": n, "max_query_len": new}  # fmt: skip


def call(module: types.ModuleType, c: dict, store: bool):  # type: ignore[no-untyped-def]
    q, k, v, offsets, k_pool, v_pool, table, seq_lens, targets, scale, alpha, ctx, window = c["args"]
    if store:
        return module.paged_hstu_mha_triton_fwd(q, k, v, offsets, k_pool, v_pool, table, seq_lens, targets, scale,
                                                alpha, ctx, window, max_seq_len=c["max_seq_len"],
                                                max_query_len=c["max_query_len"], layer=1)  # fmt: skip
    return module.paged_hstu_mha_triton_fwd(q, k, v, offsets, k_pool[1], v_pool[1], table, seq_lens, targets, scale,
                                            alpha, ctx, window, max_seq_len=c["max_seq_len"],
                                            max_query_len=c["max_query_len"])  # fmt: skip


def reference(c: dict) -> torch.Tensor:
    """The layer's attention in fp32 (PyTorch, inputs upcast): what each variant's bf16 output is measured against."""
    from hstu_export.ops.paged import paged_hstu_mha_reference

    q, k, v, offsets, k_pool, v_pool, table, seq_lens, targets, scale, alpha, ctx, window = c["args"]
    return paged_hstu_mha_reference(q.float(), k.float(), v.float(), offsets, k_pool[1].float(), v_pool[1].float(),
                                    table, seq_lens, targets, scale, alpha, ctx, window)  # fmt: skip


def timing(variants: dict[str, types.ModuleType], work: dict, batch: int, device: torch.device) -> dict:
    c = case(work, batch, device)
    first = next(iter(variants))
    row: dict = {"checks": {}}
    pools = {}
    for name, module in variants.items():
        fresh = {**c, "args": (*c["args"][:4], c["args"][4].clone(), c["args"][5].clone(), *c["args"][6:])}
        out = call(module, fresh, True)
        pools[name] = (out, fresh["args"][4], fresh["args"][5])
    want = pools[first]
    ref = reference(c)
    for name, (out, k_pool, v_pool) in pools.items():
        row["checks"][name] = {"output_equal": bool(torch.equal(out, want[0])),
                               "rel_l2_vs_fp32": float((out.float() - ref).norm() / ref.norm()),
                               "pools_equal": bool(torch.equal(k_pool[:, :-1], want[1][:, :-1])
                                                   and torch.equal(v_pool[:, :-1], want[2][:, :-1]))}  # fmt: skip
    runs: dict[str, list[float]] = {}
    for _ in range(3):
        runs.setdefault(f"{first}_no_store", []).append(
            bench_graph(lambda: call(variants[first], c, False)).get("p50_ms", float("nan")))
        for name, module in variants.items():
            runs.setdefault(name, []).append(
                bench_graph(lambda module=module: call(module, c, True)).get("p50_ms", float("nan")))
    row["p50_us_rounds"] = {name: [round(t * 1e3, 2) for t in ts] for name, ts in runs.items()}
    row["p50_us"] = {name: round(statistics.median(ts) * 1e3, 2) for name, ts in runs.items()}
    return row


def report(variants: dict[str, types.ModuleType]) -> None:
    """Each variant compiled for sm_90 as benchmarks/investigations/kernel_report.py compiles the paged kernel."""
    import kernel_report

    for name, module in variants.items():
        kernel = kernel_report.compile_paged(90, 128, 128, "bf16", 64, 64, 4, 3, kernel=module._paged_attn_fwd)
        print(json.dumps({"variant": name, "shared": kernel.metadata.shared, **kernel_report.sass_summary(kernel)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--variant", action="append", required=True, metavar="NAME=FILE")
    parser.add_argument("--workloads", nargs="+", default=["long", "dlrm"], choices=sorted(WORKLOADS))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--report", action="store_true", help="compile each variant for sm_90 (no GPU needed)")
    args = parser.parse_args()
    variants = {}
    for spec in args.variant:
        name, _, path = spec.partition("=")
        variants[name] = load_variant(name, Path(path))
    if args.report:
        report(variants)
        return
    if args.out is None:
        parser.error("--out is needed to time the variants")
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    result: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
                    "variants": {name: spec.partition("=")[2] for name, spec in zip(variants, args.variant)},
                    "workloads": {}}  # fmt: skip
    for name in args.workloads:
        for batch in args.batches:
            result["workloads"][f"{name}_{batch}"] = timing(variants, WORKLOADS[name], batch, device)
            (args.out / "paged_store.json").write_text(json.dumps(result, indent=2))
            print(name, batch, json.dumps(result["workloads"][f"{name}_{batch}"]["p50_us"]), flush=True)


if __name__ == "__main__":
    main()
