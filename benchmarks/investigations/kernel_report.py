"""Compile the HSTU attention kernels for a GPU target without a GPU and report their resources.

Triton ships ptxas, so registers, spills, shared memory and the matrix instructions used (wgmma
shows as HGMMA in SASS) can be read on a machine with no GPU:

    python benchmarks/investigations/kernel_report.py --arch 90 --dqk 128 --dv 128 --dtype bf16
    python benchmarks/investigations/kernel_report.py --kernel paged --configs 64x64x4x3   # the KV cache's delta kernel
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from hstu_export.ops._triton.attention import _hstu_attn_fwd
from hstu_export.ops._triton.paged import _paged_attn_fwd

_TYPES = {"bf16": "*bf16", "fp16": "*fp16", "fp32": "*fp32"}
# Products as a launch at torch's default fp32 matmul precision runs them (configs.dot_precision).
_PRECISION = {"bf16": "tf32", "fp16": "tf32", "fp32": "ieee"}


def compile_attention(
    arch: int, dqk: int, dv: int, dtype: str, block_m: int, block_n: int, num_warps: int, num_stages: int,
    causal: bool = True, has_targets: bool = True, skip: bool = True, delta: bool = False,
) -> triton.compiler.CompiledKernel:  # fmt: skip
    ptr = _TYPES[dtype]
    signature = {
        "Q": ptr, "K": ptr, "V": ptr, "Out": ptr, "seq_offsets": "*i64", "num_targets": "*i64",
        "stride_qm": "i32", "stride_qh": "i32", "stride_kn": "i32", "stride_kh": "i32",
        "stride_vn": "i32", "stride_vh": "i32", "stride_om": "i32", "stride_oh": "i32", "o_col0": "i32",
        "alpha": "fp32", "scaling_seqlen": "i32", "contextual_seq_len": "i32", "max_attn_len": "i32",
        "delta_size": "i32", "H": "i32",
    }  # fmt: skip
    constexprs = dict(
        DQK=dqk, DV=dv, BLOCK_DQK=max(triton.next_power_of_2(dqk), 16), BLOCK_DV=max(triton.next_power_of_2(dv), 16),
        BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal, HAS_TARGETS=has_targets, IS_DELTA=delta, SKIP=skip,
        FAST_SILU=dtype != "fp32", UPCAST_DOTS=False, DOT_PRECISION=_PRECISION[dtype],
    )  # fmt: skip
    for name in constexprs:
        signature[name] = "constexpr"
    # Pointers 16-byte aligned and strides divisible by 16, as PyTorch allocations give.
    aligned = [
        i
        for i, n in enumerate(_hstu_attn_fwd.arg_names)
        if n in signature and n.startswith(("Q", "K", "V", "Out", "seq", "num", "stride"))
    ]
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    src = ASTSource(_hstu_attn_fwd, signature, constexprs, attrs)
    return triton.compile(
        src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps, "num_stages": num_stages}
    )


def compile_paged(
    arch: int, dqk: int, dv: int, dtype: str, block_m: int, block_n: int, num_warps: int, num_stages: int,
    page: int = 64, store: bool = True, kernel: triton.runtime.jit.JITFunction = _paged_attn_fwd,
    targets_only: bool = False,
) -> triton.compiler.CompiledKernel:  # fmt: skip
    """The paged delta kernel (hstu_export/ops/_triton/paged.py, or ``kernel``: a variant of it) as an
    exported program launches it (which stores the new K/V; ``store=False``: as the benchmarks launch it
    alone; ``targets_only``: as the program's last layer launches it)."""
    ptr = _TYPES[dtype]
    signature: dict[str, str] = {}
    for name in kernel.arg_names:
        if name in ("Q", "KN", "VN", "KP", "VP", "Out"):
            signature[name] = ptr
        elif name in ("Work", "page_table", "q_offsets", "seq_lens", "num_targets"):
            signature[name] = {"Work": "*fp32", "page_table": "*i32"}.get(name, "*i64")
        elif name in ("alpha", "inv_scale"):
            signature[name] = "fp32"
        elif name.isupper() or name in ("BLOCK_DQK", "BLOCK_DV"):
            continue
        else:
            signature[name] = "i32"
    constexprs = dict(
        DQK=dqk, DV=dv, BLOCK_DQK=max(triton.next_power_of_2(dqk), 16), BLOCK_DV=max(triton.next_power_of_2(dv), 16),
        BLOCK_M=block_m, BLOCK_N=min(block_n, page), PAGE=page, CHUNK=64, FAST_SILU=dtype != "fp32", UPCAST_DOTS=False,
        PREFETCH=True, STORE=store, TARGETS_ONLY=targets_only, DOT_PRECISION=_PRECISION[dtype],
    )  # fmt: skip
    constexprs = {name: value for name, value in constexprs.items() if name in kernel.arg_names}  # older variants
    for name in constexprs:
        signature[name] = "constexpr"
    aligned = [i for i, n in enumerate(kernel.arg_names) if signature.get(n, "").startswith("*")
               or n.startswith("stride")]
    src = ASTSource(kernel, signature, constexprs, {(i,): [["tt.divisibility", 16]] for i in aligned})
    return triton.compile(
        src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps, "num_stages": num_stages}
    )


def sass_summary(kernel: triton.compiler.CompiledKernel) -> dict[str, int]:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        sass = subprocess.run([cuobjdump, "-sass", path], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run(
            [cuobjdump, "-res-usage", path], capture_output=True, text=True, check=True
        ).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", usage)
    resources = (
        {"regs": int(found[1]), "stack": int(found[2]), "static_shared": int(found[3])} if found else {}
    )
    ops = ["HGMMA", "HMMA", "MUFU.TANH", "MUFU.EX2", "MUFU.RCP", "LDGSTS", "LDL", "STL", "BAR.SYNC"]
    return resources | {op: len(re.findall(rf"\b{re.escape(op)}\b", sass)) for op in ops}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--dqk", type=int, default=128)
    parser.add_argument("--dv", type=int, default=128)
    parser.add_argument("--dtype", default="bf16", choices=sorted(_TYPES))
    parser.add_argument("--configs", default="128x64x8x3,128x64x4x3,128x128x8x2,64x64x4x3",
                        help="BLOCK_MxBLOCK_NxWARPSxSTAGES, comma separated")  # fmt: skip
    parser.add_argument("--no-skip", action="store_true")
    parser.add_argument("--kernel", choices=("attention", "paged"), default="attention")
    parser.add_argument("--no-store", action="store_true", help="paged: the kernel without its store of the new K/V")
    parser.add_argument("--targets-only", action="store_true", help="paged: the last layer's kernel (the targets' rows)")
    args = parser.parse_args()
    rows = []
    for cfg in args.configs.split(","):
        bm, bn, warps, stages = (int(x) for x in cfg.split("x"))
        if args.kernel == "paged":
            kernel = compile_paged(args.arch, args.dqk, args.dv, args.dtype, bm, bn, warps, stages,
                                   store=not args.no_store, targets_only=args.targets_only)
        else:
            kernel = compile_attention(
                args.arch, args.dqk, args.dv, args.dtype, bm, bn, warps, stages, skip=not args.no_skip
            )
        rows.append({"config": cfg, "shared": kernel.metadata.shared, **sass_summary(kernel)})
        print(json.dumps(rows[-1]), flush=True)


if __name__ == "__main__":
    main()
