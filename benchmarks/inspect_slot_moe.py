"""The decode down launches of `slot_moe` compiled for a CUDA target without a GPU: what their machine code
does, read on any machine with Triton (its bundled cuobjdump reads the cubin).

Per launch ("two_stage": `_down_decode`, "pairs": `_down_decode_pairs`) and block shape: the registers per
thread, the global loads, the barriers, how many loads are issued before the first barrier (all of them:
every expert's weights in flight at once), and local-memory spills. This is not a timing: arguments are
compiled without the alignment hints the runtime's calls get (the loads come out 2 bytes wide), so the
counts are the code's shape, and only a GPU measures its speed (bench_slot_moe.py).

    python benchmarks/inspect_slot_moe.py --blocks 8,128,8 16,256,4
    git worktree add /tmp/before c57c5d4 && python benchmarks/inspect_slot_moe.py --kernels /tmp/before/kernels

`--kernels` reads `moecache_kernels` from another tree (an earlier commit's launches, for comparison; a
variant it lacks is left out, arguments it lacks are not passed).

Prints a table and ends with one JSON line. Shape legend: H hidden, I intermediate, K top-k.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[1] / "kernels"


def compiled(fn, signature: dict, constexprs: dict, num_warps: int, arch: int) -> bytes:
    """The cubin of jit function `fn` for sm_<arch>."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps}).asm[
        "cubin"
    ]


def shape_of(cubin: bytes) -> dict:
    """Registers, loads, barriers, loads before the first barrier and spills of one cubin."""
    import triton.backends.nvidia as nvidia

    cuobjdump = os.path.join(os.path.dirname(nvidia.__file__), "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True, check=True)
        sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    ops = re.findall(r"\b(LDG|BAR|STL)\b", sass)
    first_bar = ops.index("BAR") if "BAR" in ops else len(ops)
    return {
        "registers": int(re.search(r"REG:(\d+)", usage.stdout).group(1)),
        "loads": ops.count("LDG"),
        "barriers": ops.count("BAR"),
        "loads_before_first_barrier": ops[:first_bar].count("LDG"),
        "spills": ops.count("STL"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", nargs="+", default=["8,128,8", "16,256,4"], help="BLOCK_H,BLOCK_I,num_warps")
    ap.add_argument("--inter", type=int, default=512, help="I (Qwen3.6: 512)")
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--kernels", type=Path, default=KERNELS, help="the folder holding moecache_kernels")
    args = ap.parse_args()
    if not (args.kernels / "moecache_kernels" / "slot_moe.py").is_file():
        ap.error(f"--kernels {args.kernels}: no moecache_kernels/slot_moe.py there")
    sys.path.insert(0, str(args.kernels))
    blocks = []
    for b in args.blocks:
        try:
            blocks.append(tuple(int(v) for v in b.split(",")))
        except ValueError:
            ap.error(f"--blocks {b!r}: want BLOCK_H,BLOCK_I,num_warps")
        if len(blocks[-1]) != 3:
            ap.error(f"--blocks {b!r}: want BLOCK_H,BLOCK_I,num_warps")
    import triton.language as tl
    from moecache_kernels import slot_moe  # noqa: F401  (the function; the module below)

    kernel = sys.modules["moecache_kernels.slot_moe"]
    common = {"act_ptr": "*fp32", "slot_P_ptr": "*i32", "wts_ptr": "*fp32", "w2_ptr": "*bf16", "H": "i32",
              "I": "constexpr", "stride_ws": "i32", "stride_wh": "i32", "BLOCK_H": "constexpr",
              "BLOCK_I": "constexpr", "RD": "constexpr", "ROUND_PRODUCT": "constexpr"}  # fmt: skip
    launches = {
        "two_stage": ("_down_decode", common | {"y_ptr": "*fp32", "K": "constexpr", "stride_yt": "i32"}),
        "pairs": ("_down_decode_pairs", common | {"out_ptr": "*fp32", "stride_op": "i32"}),
    }
    rows = []
    for variant, (name, signature) in launches.items():
        fn = getattr(kernel, name, None)
        if fn is None:
            continue
        params = inspect.signature(fn.fn).parameters
        signature = {k: v for k, v in signature.items() if k in params}
        for block_h, block_i, warps in blocks:
            consts = {"I": args.inter, "K": args.top_k, "BLOCK_H": block_h, "BLOCK_I": block_i,
                      "RD": tl.bfloat16, "ROUND_PRODUCT": True}  # fmt: skip
            consts = {k: v for k, v in consts.items() if k in signature}
            cubin = compiled(fn, signature, consts, warps, args.arch)
            rows.append({"variant": variant, "BLOCK_H": block_h, "BLOCK_I": block_i, "num_warps": warps,
                         **shape_of(cubin)})  # fmt: skip
    print(
        f"slot_moe decode down launches for sm_{args.arch}, I {args.inter}, K {args.top_k}, bf16, no alignment hints"
    )
    cols = ["variant", "BLOCK_H", "BLOCK_I", "num_warps", "registers", "loads", "barriers",
            "loads_before_first_barrier", "spills"]  # fmt: skip
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(str(r[c]) for c in cols))
    print(json.dumps({"bench": "inspect_slot_moe", "arch": args.arch, "inter": args.inter, "rows": rows}))


if __name__ == "__main__":
    main()
