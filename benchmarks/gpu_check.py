"""Correctness of the Triton kernels at realistic sizes on a GPU, plus one AOTInductor round trip.

Every check compares against the pure-torch reference (hstu_export/ops/reference.py) computed in
fp32 from the same inputs, by ||out - ref|| / ||ref||; outputs start as NaN (PyTorch's
fill_uninitialized_memory), so an element a kernel never writes fails the check. Results go to
``<out>/gpu_check.json``.

    PYTHONPATH=$PWD python benchmarks/gpu_check.py --out $OUT
    TRITON_INTERPRET=1 python benchmarks/gpu_check.py --device cpu --small   # a dry run on a CPU
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_imports import import_kernels

kernels, reference = import_kernels()

# fp32 inputs run their products as torch's fp32 matmul precision says (ops/_triton/configs.py dot_precision): in
# full fp32 at its default, in TF32 under --fp32-precision high (~1.6e-3 measured on H200).
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float32: 1e-4}
TF32_TOLERANCE = 5e-3


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def offsets_of(lengths: list[int], device: str) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64, device=device)


def attention_case(
    name: str, device: str, gen: torch.Generator, *, lengths: list[int], H: int, dqk: int, dv: int,
    dtype: torch.dtype, targets: list[int] | None = None, context: int = 0, window: int = 0,
    causal: bool = True, delta: int = 0, skip: bool = True,
) -> dict[str, Any]:  # fmt: skip
    offsets = offsets_of(lengths, device)
    L = int(offsets[-1])
    q = torch.randn(L, H, dqk, generator=gen, device=device).to(dtype)
    k = torch.randn(L, H, dqk, generator=gen, device=device).to(dtype)
    v = torch.randn(L, H, dv, generator=gen, device=device).to(dtype)
    num_targets = None if targets is None else torch.tensor(targets, dtype=torch.int64, device=device)
    max_seq_len = max(lengths)
    scaling_seqlen, alpha = max_seq_len, 1.0 / math.sqrt(dqk)
    args = (scaling_seqlen, alpha)
    start = time.perf_counter()
    if delta:
        rows = torch.cat(
            [torch.arange(int(offsets[b + 1]) - delta, int(offsets[b + 1])) for b in range(len(lengths))]
        )
        delta_q = q[rows.to(device)].contiguous()
        out = torch.ops.hstu_export.cached_hstu_mha_triton(
            delta_q, k, v, offsets, delta, max_seq_len, *args, num_targets, context, window
        )
        ref = reference.cached_hstu_mha_reference(
            delta_q.float(),
            k.float(),
            v.float(),
            offsets,
            delta,
            max_seq_len,
            *args,
            num_targets,
            context,
            window,
        )
    else:
        out = kernels.hstu_mha_triton_fwd(
            q, k, v, offsets, max_seq_len, *args, causal, num_targets, context, window, block_skipping=skip
        )
        ref = reference.hstu_mha_reference(
            q.float(), k.float(), v.float(), offsets, max_seq_len, *args, causal, num_targets, context, window
        )
    if device == "cuda":
        torch.cuda.synchronize()
    err = rel_err(out, ref)
    return {
        "name": name, "rel_err": err, "tolerance": TOLERANCE[dtype], "passed": err < TOLERANCE[dtype],
        "dtype": str(dtype), "B": len(lengths), "tokens": L, "H": H, "dqk": dqk, "dv": dv,
        "seconds": round(time.perf_counter() - start, 2),
    }  # fmt: skip


def attention_cases(device: str, small: bool) -> list[dict[str, Any]]:
    gen = torch.Generator(device=device).manual_seed(0)
    cpu_gen = torch.Generator().manual_seed(1)

    def lengths(B: int, lo: int, hi: int) -> list[int]:
        return torch.randint(lo, hi + 1, (B,), generator=cpu_gen).tolist()

    scale = 16 if small else 1
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    jag = lengths(8, 1, 2048 // scale)
    jag[0] = 1
    tg = [min(n, t) for n, t in zip(jag, lengths(8, 0, 300 // scale))]
    tg_ctx = [max(min(n - 8, t), 0) for n, t in zip(jag, tg)]
    dl = [max(n, 64 // scale) for n in jag]
    dl_t = [min(n, t) for n, t in zip(dl, tg)]
    hist = lengths(4, 1, 2048 // scale)
    dlrm = [h + 2048 // scale for h in hist]
    specs: list[tuple[str, dict[str, Any]]] = [
        ("full_causal_n1024_d128_bf16", dict(lengths=[1024 // scale] * 8, H=4, dqk=128, dv=128, dtype=bf16)),
        ("jagged_targets_d128_bf16", dict(lengths=jag, H=4, dqk=128, dv=128, dtype=bf16, targets=tg)),
        ("jagged_all_features_d128_bf16", dict(lengths=jag, H=4, dqk=128, dv=128, dtype=bf16, targets=tg_ctx, context=8, window=256 // scale)),
        ("jagged_all_features_no_skip_bf16", dict(lengths=jag, H=4, dqk=128, dv=128, dtype=bf16, targets=tg_ctx, context=8, window=256 // scale, skip=False)),
        ("dqk64_dv128_targets_bf16", dict(lengths=jag, H=2, dqk=64, dv=128, dtype=bf16, targets=tg)),
        ("d40_targets_context_fp16", dict(lengths=jag, H=2, dqk=40, dv=40, dtype=fp16, targets=tg_ctx, context=8)),
        ("d24_window_bf16", dict(lengths=jag, H=2, dqk=24, dv=24, dtype=bf16, window=100 // scale)),
        ("dqk200_dv96_targets_bf16", dict(lengths=jag, H=2, dqk=200, dv=96, dtype=bf16, targets=tg)),
        ("d256_targets_bf16", dict(lengths=jag, H=2, dqk=256, dv=256, dtype=bf16, targets=tg)),
        ("d128_targets_fp32", dict(lengths=jag, H=2, dqk=128, dv=128, dtype=fp32, targets=tg)),
        ("d24_dv40_all_features_fp32", dict(lengths=jag, H=2, dqk=24, dv=40, dtype=fp32, targets=tg_ctx, context=8, window=256 // scale)),
        ("noncausal_d64_bf16", dict(lengths=jag, H=2, dqk=64, dv=64, dtype=bf16, causal=False)),
        ("dlrmv3_like_b4_bf16", dict(lengths=dlrm, H=4, dqk=128, dv=128, dtype=bf16, targets=[2048 // scale] * 4)),
        ("cached_delta64_targets_context_bf16", dict(lengths=dl, H=4, dqk=128, dv=128, dtype=bf16, targets=dl_t, context=0, window=0, delta=64 // scale)),
        ("cached_delta16_all_features_bf16", dict(lengths=dl, H=2, dqk=64, dv=64, dtype=bf16, targets=[max(min(n - 8, t), 0) for n, t in zip(dl, tg)], context=8, window=128 // scale, delta=16 // scale)),
        ("cached_delta1_fp32", dict(lengths=dl, H=2, dqk=32, dv=48, dtype=fp32, delta=1)),
    ]  # fmt: skip
    results = []
    for name, spec in specs:
        results.append(attention_case(name, device, gen, **spec))
        print(json.dumps(results[-1]), flush=True)
    return results


def gated_cases(device: str, small: bool) -> list[dict[str, Any]]:
    """hstu_mha_gated_triton (attention into the concat buffer + the gate kernel) against the fp32
    reference of the op, and the searchsorted jagged positions against the running count."""
    gen = torch.Generator(device=device).manual_seed(5)
    cpu_gen = torch.Generator().manual_seed(6)
    scale = 16 if small else 1
    hist = torch.randint(1, 2048 // scale + 1, (8,), generator=cpu_gen).tolist()
    lengths = [h + 2048 // scale for h in hist]
    specs = [  # name, H, Dqk, Dv, dtype
        ("gated_dlrmv3_like_bf16", 4, 128, 128, torch.bfloat16),
        ("gated_width120_fp16", 3, 32, 40, torch.float16),
        ("gated_width2048_bf16", 8, 64, 256, torch.bfloat16),
        ("gated_d64_fp32", 2, 64, 64, torch.float32),
    ]
    offsets = offsets_of(lengths, device)
    L = int(offsets[-1])
    targets = torch.full((len(lengths),), 2048 // scale, dtype=torch.int64, device=device)
    results = []
    for name, H, dqk, dv, dtype in specs:
        width = H * dv
        uvqk = torch.randn(L, 2 * width + 2 * H * dqk, generator=gen, device=device).to(dtype)
        weight = (1 + 0.2 * torch.randn(width, generator=gen, device=device)).to(dtype)
        bias = (0.1 * torch.randn(width, generator=gen, device=device)).to(dtype)
        args = (H, dqk, dv, max(lengths), max(lengths), 1.0 / math.sqrt(dqk), True, targets, 0, 0, 1e-6)
        start = time.perf_counter()
        out = torch.ops.hstu_export.hstu_mha_gated_triton(uvqk, offsets, weight, bias, *args)
        ref = reference.hstu_mha_gated_reference(uvqk.float(), offsets, weight.float(), bias.float(), *args)
        if device == "cuda":
            torch.cuda.synchronize()
        err = rel_err(out, ref)
        results.append({
            "name": name, "rel_err": err, "tolerance": TOLERANCE[dtype], "passed": err < TOLERANCE[dtype],
            "dtype": str(dtype), "tokens": L, "H": H, "dqk": dqk, "dv": dv,
            "seconds": round(time.perf_counter() - start, 2),
        })  # fmt: skip
        print(json.dumps(results[-1]), flush=True)
    from hstu_export.ops.jagged import jagged_positions_by_search

    got = jagged_positions_by_search(offsets, L)
    expected = reference.jagged_positions(offsets, L)
    exact = all(torch.equal(g, e) for g, e in zip(got, expected))
    results.append({"name": "jagged_positions_search", "rel_err": 0.0 if exact else 1.0, "passed": exact})
    print(json.dumps(results[-1]), flush=True)
    return results


def jagged_cases(device: str, small: bool) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(2)
    B, D = 32, 512 // (8 if small else 1)
    lengths = torch.randint(0, 3000 // (16 if small else 1), (B,), generator=gen).tolist()
    right_lengths = torch.randint(0, 2048 // (16 if small else 1), (B,), generator=gen).tolist()
    offsets, offsets_r = offsets_of(lengths, device), offsets_of(right_lengths, device)
    La, Lb = int(offsets[-1]), int(offsets_r[-1])
    max_len = 2048 // (16 if small else 1)
    results = []

    def random(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if dtype == torch.int64:  # ids: exact copies only
            return torch.randint(-(2**62), 2**62, shape, device=device)
        return torch.randn(shape, device=device).to(dtype)

    # (dtype, trailing dims of a row): 2-D values as the model uses, 1-D ids, 3-D rows.
    for dtype, rest in (
        (torch.bfloat16, (D,)),
        (torch.float32, (D,)),
        (torch.int64, ()),
        (torch.bfloat16, (4, 96)),
    ):
        values = random((La, *rest), dtype)
        right = random((Lb, *rest), dtype)
        dense = random((B, max_len, *rest), dtype)
        joined = reference.concat_2D_jagged_reference(values, offsets, right, offsets_r)
        checks = {
            "jagged_to_padded_dense": (
                torch.ops.hstu_export.jagged_to_padded_dense_triton(values, offsets, max_len, -1.0),
                reference.jagged_to_padded_dense_reference(values, offsets, max_len, -1.0),
            ),
            "dense_to_jagged": (
                torch.ops.hstu_export.dense_to_jagged_triton(dense, offsets, La),
                reference.dense_to_jagged_reference(dense, offsets, La),
            ),
            "concat_2D_jagged": (
                torch.ops.hstu_export.concat_2D_jagged_triton(values, offsets, right, offsets_r),
                joined,
            ),
            "split_2D_jagged": (
                torch.cat(torch.ops.hstu_export.split_2D_jagged_triton(joined, offsets, offsets_r, La, Lb)),
                torch.cat([values, right]),
            ),
        }
        for name, (out, ref) in checks.items():
            exact = bool(torch.equal(out, ref))
            results.append(
                {
                    "name": f"{name}_{str(dtype).split('.')[-1]}_{'x'.join(map(str, rest)) or 'scalar'}",
                    "exact": exact,
                    "passed": exact,
                    "shape": list(out.shape),
                }
            )
            print(json.dumps(results[-1]), flush=True)
    return results


class _TinyTransducer(torch.nn.Module):
    """Every hstu_export::*_triton op in one graph: concat history and candidates, attend (candidates as
    targets), split, pad the candidates and back."""

    def __init__(self, dim: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.qkv = torch.nn.Linear(dim, 3 * heads * head_dim)

    def forward(
        self,
        history: torch.Tensor,
        offsets: torch.Tensor,
        candidates: torch.Tensor,
        cand_offsets: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ops = torch.ops.hstu_export
        joined = ops.concat_2D_jagged_triton(history, offsets, candidates, cand_offsets)
        num_targets = cand_offsets[1:] - cand_offsets[:-1]
        L = joined.shape[0]
        q, k, v = self.qkv(joined).view(L, 3, self.heads, self.head_dim).unbind(1)
        alpha = 1.0 / math.sqrt(self.head_dim)
        attn = ops.hstu_mha_triton(q, k, v, offsets + cand_offsets, 256, 256, alpha, True, num_targets, 0, 0)
        hist, cand = ops.split_2D_jagged_triton(
            attn.reshape(L, -1), offsets, cand_offsets, history.shape[0], candidates.shape[0]
        )
        padded = ops.jagged_to_padded_dense_triton(cand, cand_offsets, 8, -1.0)
        back = ops.dense_to_jagged_triton(padded * 2.0, cand_offsets, candidates.shape[0])
        return hist, back, padded


def aoti_round_trip(out_dir: Path) -> dict[str, Any]:
    """export -> aoti_compile_and_package -> aoti_load_package -> run on a batch of another size."""
    torch.manual_seed(3)
    model = _TinyTransducer(64, 2, 32).cuda().to(torch.bfloat16).eval()

    def batch(lengths: list[int], candidates: list[int]) -> tuple[torch.Tensor, ...]:
        offsets, cand_offsets = offsets_of(lengths, "cuda"), offsets_of(candidates, "cuda")
        history = torch.randn(int(offsets[-1]), 64, device="cuda", dtype=torch.bfloat16)
        cands = torch.randn(int(cand_offsets[-1]), 64, device="cuda", dtype=torch.bfloat16)
        return history, offsets, cands, cand_offsets

    example = batch([100, 37, 200], [3, 1, 8])
    L, Lc = torch.export.Dim("L", min=2, max=65536), torch.export.Dim("Lc", min=2, max=65536)
    B = torch.export.Dim("B", min=2, max=1024)
    dynamic = {"history": {0: L}, "offsets": {0: B + 1}, "candidates": {0: Lc}, "cand_offsets": {0: B + 1}}
    start = time.perf_counter()
    with torch.no_grad():
        ep = torch.export.export(model, example, dynamic_shapes=dynamic)
        path = torch._inductor.aoti_compile_and_package(ep, package_path=str(out_dir / "tiny_transducer.pt2"))
    compile_s = time.perf_counter() - start
    loaded = torch._inductor.aoti_load_package(path)
    results: dict[str, Any] = {"compile_seconds": round(compile_s, 1), "package_bytes": os.path.getsize(path)}
    for label, args in [("example", example), ("other_batch", batch([240, 1, 5, 120, 64], [8, 2, 0, 7, 5]))]:
        with torch.no_grad():
            eager = model(*args)
            aoti = loaded(*args)
        torch.cuda.synchronize()
        results[label] = {
            "max_abs_err": max(float((a.float() - e.float()).abs().max()) for a, e in zip(aoti, eager)),
            "rel_err": max(rel_err(a, e.float()) for a, e in zip(aoti, eager)),
        }
    results["passed"] = all(results[k]["rel_err"] < 1e-3 for k in ("example", "other_batch"))
    # Speed of the packaged model against eager on 64 users of 192 history tokens + 8 candidates.
    import triton.testing

    timing_batch = batch([192] * 64, [8] * 64)
    with torch.no_grad():
        results["eager_ms_64x200"] = triton.testing.do_bench(
            lambda: model(*timing_batch), return_mode="median"
        )
        results["aoti_ms_64x200"] = triton.testing.do_bench(
            lambda: loaded(*timing_batch), return_mode="median"
        )
    results["graph_ops"] = sorted({str(n.target) for n in ep.graph.nodes if n.op == "call_function"})
    print(json.dumps(results), flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="tiny sizes (for a dry run on a CPU)")
    parser.add_argument("--parts", default="attention,gated,jagged,aoti", help="comma-separated subset to run")
    parser.add_argument("--fp32-precision", default="highest", choices=["highest", "high"],
                        help="torch.set_float32_matmul_precision for the run: high multiplies fp32 in TF32")
    args = parser.parse_args()
    torch.set_float32_matmul_precision(args.fp32_precision)
    if args.fp32_precision != "highest":
        TOLERANCE[torch.float32] = TF32_TOLERANCE
    args.out.mkdir(parents=True, exist_ok=True)
    warnings.filterwarnings("ignore")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True  # torch.empty outputs start as NaN
    env = {
        "python": platform.python_version(), "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu (interpreter)",
        "capability": list(torch.cuda.get_device_capability()) if args.device == "cuda" else None,
        "fp32_precision": args.fp32_precision,
    }  # fmt: skip
    print(json.dumps(env), flush=True)
    report: dict[str, Any] = {"env": env}
    parts = set(args.parts.split(","))
    report["attention"] = attention_cases(args.device, args.small) if "attention" in parts else []
    report["gated"] = gated_cases(args.device, args.small) if "gated" in parts else []
    report["jagged"] = jagged_cases(args.device, args.small) if "jagged" in parts else []
    torch.use_deterministic_algorithms(False)
    if args.device == "cuda" and "aoti" in parts:
        with tempfile.TemporaryDirectory() as tmp:
            try:
                report["aoti"] = aoti_round_trip(Path(tmp))
            except Exception as exc:  # report it with the rest instead of losing the other results
                report["aoti"] = {"passed": False, "error": f"{type(exc).__name__}: {exc}"[:4000]}
                print(json.dumps(report["aoti"]), flush=True)
    report["chosen_configs"] = kernels.chosen_configs()
    failed = [c["name"] for c in report["attention"] + report["gated"] + report["jagged"] if not c["passed"]]
    if "aoti" in report and not report["aoti"]["passed"]:
        failed.append("aoti")
    report["failed"] = failed
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=2))
    print("\n== gpu_check ==")
    for case in report["attention"] + report["gated"]:
        print(f"{case['name']:40s} rel_err {case['rel_err']:.2e}  {'ok' if case['passed'] else 'FAIL'}")
    print(f"jagged ops exact: {all(c['passed'] for c in report['jagged'])}")
    if "aoti" in report:
        print(f"aoti: {report['aoti']}")
    print(f"failed: {failed}")


if __name__ == "__main__":
    main()
