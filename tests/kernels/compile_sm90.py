"""Compile every Triton kernel of runtime/kernels ahead of time for the H200 (sm_90) on a machine without a GPU: Triton
lowers them through TTIR, TTGIR, LLVM IR and PTX to a cubin (its bundled ptxas), so an error that only the compiler
sees (types, layouts, shared memory) shows here rather than on the device. Run by test_compile_sm90.py in a
process without TRITON_INTERPRET (under the interpreter @triton.jit gives no compilable function). Prints one line
per kernel and mode (for the kernels that read a segment table, their registers and spills from ptxas -v) and exits
1 on any failure."""
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from runtime.kernels import indexer, merge, mhc, multiseg, rmsnorm, rope, sparse_attention, swiglu  # noqa: E402

FUSED = dict(q_ptr="*bf16", qpos_ptr="*i64", tab_ptr="*i64", picks_ptr="*i32", bounds_ptr="*i32", freq_ptr="*fp32",
             sink_ptr="*fp32", o_ptr="*bf16", qk_scale="fp32", sink_scale="fp32", turn_ptr="*fp32")
STACKED = dict(q_ptr="*bf16", k_ptr="*bf16", e_ptr="*bf16", cpos_ptr="*i64", picks_ptr="*i32", o_ptr="*fp32",
               lse_ptr="*fp32", qk_scale="fp32", tab_ptr="*i64", prog_ptr="*i64", cos_ptr="*fp32", sin_ptr="*fp32",
               stride_op="i64", stride_lp="i64", runs_ptr="*i64", stride_rt="i64")
MERGE = dict(o_ptr="*fp32", lse_ptr="*fp32", sink_ptr="*fp32", out_ptr="*bf16")
MERGE_N = dict(o_tab="*i64", lse_tab="*i64", sink_ptr="*fp32", out_ptr="*bf16", lse_out_ptr="*fp32")
INDEXER = dict(q_ptr="*bf16", k_ptr="*bf16", w_ptr="*fp32", cpos_ptr="*i64", o_ptr="*fp32", scale="fp32")
HC_MIX = dict(x_ptr="*bf16", fn_ptr="*fp32", mix_ptr="*fp32", norm_eps="fp32")
HC_WEIGHTS = dict(x_ptr="*bf16", mix_ptr="*fp32", base_ptr="*fp32", scale_ptr="*fp32", pre_ptr="*fp32",
                  post_ptr="*fp32", comb_ptr="*fp32", out_ptr="*bf16", hc_eps="fp32")
HC_POST = dict(y_ptr="*bf16", x_ptr="*bf16", post_ptr="*fp32", comb_ptr="*fp32", out_ptr="*bf16",
               yrow_ptr="*i64", orow_ptr="*i64")
ROPE = dict(x_ptr="*bf16", s_ptr="*bf16", cos_ptr="*fp32", sin_ptr="*fp32", rows_ptr="*i64")
RMS = dict(x_ptr="*bf16", w_ptr="*fp32", y_ptr="*bf16", eps="fp32")
SWIGLU = dict(g_ptr="*bf16", u_ptr="*bf16", w_ptr="*fp32", h_ptr="*bf16", limit="fp32")
FUSED_C = dict(D=512, HALF_R=32, RP=32, COLS=multiseg.COLS, PREC="tf32")
# Flash's dims (D = 512, 64 rope channels) at the launch configurations the wrappers use by default:
# (name, kernel, argument types, constexprs, num_warps, modes)
KERNELS = [
    ("fused one-row, 64 heads", multiseg._multiseg_kernel, FUSED,
     dict(FUSED_C, BLOCK_H=64, BLOCK_N=64, SPAN=True, PB=128), 8, True),
    ("fused key-frame, 64 heads", multiseg._multiseg_keyframe_kernel, FUSED,
     dict(FUSED_C, ROWS=1, BLOCK_H=64, BLOCK_N=64, PB=128), 8, True),
    ("fused key-frame, 8 heads padded to 16", multiseg._multiseg_keyframe_kernel, FUSED,
     dict(FUSED_C, ROWS=1, BLOCK_H=16, BLOCK_N=64, PB=128), 4, True),
    ("fused key-frame, 8 heads x 8 rows", multiseg._multiseg_keyframe_kernel, FUSED,
     dict(FUSED_C, ROWS=multiseg.KEY_ROWS // 8, BLOCK_H=8, BLOCK_N=64, PB=128), 8, True),
    ("fused packed, 8 heads x 2 rows", multiseg._multiseg_packed_kernel, FUSED,
     dict(FUSED_C, ROWS=2, BLOCK_H=8, BLOCK_N=32, SPAN=True, PB=128), 4, True),
    ("stacked part, 64 heads", sparse_attention._sparse_mqa_kernel, STACKED,
     dict(D=512, DV=512, BLOCK_H=64, BLOCK_N=64, PREC="tf32", PARTS=False, HALF=1, RUNS=False), 8, True),
    ("stacked part, 8 heads", sparse_attention._sparse_mqa_kernel, STACKED,
     dict(D=512, DV=512, BLOCK_H=16, BLOCK_N=64, PREC="tf32", PARTS=False, HALF=1, RUNS=False), 4, True),
    ("stacked part, 8 heads x 8 rows", sparse_attention._sparse_mqa_rows_kernel, STACKED,
     dict(D=512, ROWS=8, BLOCK_H=8, BLOCK_N=64, PREC="tf32", PARTS=False, HALF=1), 8, True),
    ("stacked parts in one launch, 8 heads", sparse_attention._sparse_mqa_kernel, STACKED,
     dict(D=512, DV=512, BLOCK_H=16, BLOCK_N=64, PREC="tf32", PARTS=True, HALF=32, RUNS=False), 4, True),
    ("stacked parts in one launch, 8 heads, each part's run of sorted picks", sparse_attention._sparse_mqa_kernel,
     STACKED, dict(D=512, DV=512, BLOCK_H=16, BLOCK_N=64, PREC="tf32", PARTS=True, HALF=32, RUNS=True), 4, True),
    ("stacked parts in one launch, 8 heads x 8 rows", sparse_attention._sparse_mqa_rows_kernel, STACKED,
     dict(D=512, ROWS=8, BLOCK_H=8, BLOCK_N=64, PREC="tf32", PARTS=True, HALF=32), 8, True),
    ("stacked merge", merge._merge_stacked_kernel, MERGE, dict(D=512, BLOCK_R=8, BLOCK_D=512), 4, False),
    ("N-way merge", merge._merge_kernel, MERGE_N, dict(HAS_SINK=True, D=512, BLOCK_R=8, BLOCK_D=512), 4, False),
    ("indexer scores", indexer._indexer_scores_kernel, INDEXER,
     dict(IH=64, ID=128, BLOCK_T=64, BLOCK_N=128, PREC="tf32"), 4, False),
    ("indexer scores over every segment in one launch", indexer._indexer_parts_kernel,
     dict(INDEXER, seg_ptr="*i64", prog_ptr="*i64", cs_ptr="*fp32"),
     dict(IH=64, ID=128, HALF=32, BLOCK_T=64, BLOCK_N=128, PREC="tf32"), 4, False),
    ("mHC mix, split bf16 dots", mhc._hc_mix_kernel, HC_MIX, dict(MIX=24, MIXP=32, BT=128, BK=64, SPLIT=True), 8,
     False),
    ("mHC mix, float32 FMA dot", mhc._hc_mix_kernel, dict(HC_MIX, x_ptr="*fp32"),
     dict(MIX=24, MIXP=32, BT=32, BK=64, SPLIT=False), 4, False),
    ("mHC weights", mhc._hc_weights_kernel, HC_WEIGHTS, dict(HC=4, BT=16, BD=256), 4, False),
    ("mHC post", mhc._hc_post_kernel, HC_POST, dict(HC=4, BT=16, BD=128, Y_ROWS=False, OUT_ROWS=False), 4, False),
    ("mHC post, row maps", mhc._hc_post_kernel, HC_POST, dict(HC=4, BT=16, BD=128, Y_ROWS=True, OUT_ROWS=True), 4,
     False),
    ("RoPE slice", rope._rope_kernel, ROPE, dict(INVERSE=False, HALF=32, BLOCK_H=16, ROW_IDS=False), 1, False),
    ("RoPE slice, listed rows", rope._rope_kernel, dict(ROPE, x_ptr="*fp32", s_ptr="*fp32"),
     dict(INVERSE=True, HALF=32, BLOCK_H=16, ROW_IDS=True), 1, False),
    ("RMS norm, 4096 wide", rmsnorm._rms_norm_kernel, RMS, dict(BLOCK=4096), 8, False),
    ("RMS norm, unweighted, 512 wide (per head)", rmsnorm._rms_norm_kernel, RMS, dict(BLOCK=512, HAS_W=False), 1,
     False),
    ("SwiGLU, clamped and weighted", swiglu._swiglu_kernel, SWIGLU,
     dict(HAS_LIMIT=True, HAS_W=True, BLOCK=swiglu.BLOCK), 4, False),
]


# kernels that read their keys at addresses loaded from a table (a segment table): Triton knows nothing of such an
# address's alignment unless the kernel says so (tl.multiple_of), and without it every key tile is read two bytes
# at a time with no asynchronous copy (the stacked parts ran at half a launch per part's speed on an H100)
TABLE_READS = ("fused", "stacked parts in one launch", "indexer scores over every segment")
# 16-byte global reads in PTX: an asynchronous copy to shared memory of 16 bytes, or a 4 x 32-bit vector load
WIDE = re.compile(r"cp\.async\.c[ag]\.shared\.global(?:\.L2::\w+)? \[[^\]]+\], \[[^\]]+\], (?:16|0x10)\b"
                  r"|ld\.global(?:\.nc)?(?:\.L1::\w+)?(?:\.L2::\w+)?\.v4\.(?:b32|f32|u32)")


PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
SPILLS = re.compile(r"Used (\d+) registers|(\d+) bytes spill stores")


def registers(ptx: str) -> str:
    """The attention kernels' registers per thread and spill stores (bytes per thread), from the bundled ptxas -v:
    a kernel that spills its tile state to local memory in its inner loop runs far below its tile's roofline."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        run = subprocess.run([PTXAS, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull], capture_output=True,
                             text=True, timeout=300)
    regs = spill = "?"
    for used, stores in SPILLS.findall(run.stderr):
        regs, spill = used or regs, stores or spill
    return f", registers {regs}, spill stores {spill} bytes"


def main() -> int:
    failed = 0
    for name, kern, types, consts, warps, modal in KERNELS:
        for mode, code in (multiseg.MODES.items() if modal else [("-", None)]):
            const = dict(consts, **({"MODE": code} if modal else {}))
            sig = {a: "constexpr" if a in const else types.get(a, "i32") for a in kern.arg_names}
            # as at a launch: Triton specialises every pointer argument on its 16-byte alignment (torch's
            # allocations have it)
            attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(kern.arg_names) if sig[a].startswith("*")}
            src = ASTSource(fn=kern, signature=sig, attrs=attrs,
                            constexprs={(kern.arg_names.index(k),): v for k, v in const.items()})
            try:
                out = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                     options=dict(num_warps=warps, num_stages=2))
                wide = len(WIDE.findall(out.asm["ptx"]))
                regs = registers(out.asm["ptx"]) if name.startswith(TABLE_READS) and os.path.exists(PTXAS) else ""
                print(f"{name}, {mode}: cubin {len(out.asm['cubin'])} bytes, shared memory {out.metadata.shared}, "
                      f"16-byte reads {wide}{regs}")
                if name.startswith(TABLE_READS) and wide == 0:
                    failed += 1
                    print(f"{name}, {mode}: FAILED: no 16-byte read (the table's addresses not known aligned?)")
            except Exception as e:  # noqa: BLE001 - every failure is reported, then the exit code says it
                failed += 1
                print(f"{name}, {mode}: FAILED {type(e).__name__}: {e}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
