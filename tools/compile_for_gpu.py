"""Compile every chunked Triton kernel, and every fused layer kernel (kernels_reslin_triton_layers,
kernels_reslin_triton_decode's decode kernel on a projection and the generation step's GEMV
kernels of kernels_reslin_triton_gemv), for an H200 (sm_90) on any machine, GPU or not, and check
what the compiler can tell without running: that each variant compiles, and that its shared
memory fits the GPU (232448 bytes on an H200; a launch past it fails with OutOfResources).
Device time is scarce: this catches compile errors and shared-memory overflows before a GPU run.
`--registers` reports each variant's registers and spills from Triton's bundled ptxas.

    python tools/compile_for_gpu.py [--head-sizes 64 128 256] [--dtypes bf16 fp32] [--registers] [--layers-only]
    python tools/compile_for_gpu.py --gemv-only --registers   # kernels_reslin_triton_gemv alone
    python tools/compile_for_gpu.py --head-sizes 128 --dtypes bf16 --registers --cap _chunk_wy_kernel=168

`--cap KERNEL=N` compiles that kernel's every variant at N registers (ptxas's maxnreg) in place
of the launch's own cap (`kernels_reslin_triton_tuning.register_cap`): what a cap would spill,
before a GPU call times it. A 4-warp program on an H200 runs four to a SM at <= 128 registers,
three at <= 168, two at <= 256, and as many as its shared memory allows (232448 B a SM).

The chunked kernels' variants (tiles, warps, stages, flags) are the launch table of
kernels_reslin_triton_tuning (`launch_variants`), the choices the host code makes.
"""

import argparse
import itertools
import inspect
import os
import re
import subprocess
import sys
import tempfile
import time
import unittest.mock

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import kernels_reslin_triton_backward  # noqa: E402
import kernels_reslin_triton_choice as choice_kernels  # noqa: E402
import kernels_reslin_triton_decode as decode_kernels  # noqa: E402
import kernels_reslin_triton_forward  # noqa: E402
import kernels_reslin_triton_gemv as gemv_kernels  # noqa: E402
import kernels_reslin_triton_launch  # noqa: E402
import kernels_reslin_triton_layers as layer_kernels  # noqa: E402
import kernels_reslin_triton_output  # noqa: E402
import kernels_reslin_triton_state  # noqa: E402
import kernels_reslin_triton_tuning as tuning  # noqa: E402
import kernels_reslin_triton_wy  # noqa: E402

# The chunked kernels by name, as the launch table names them.
KERNELS = {name: value for module in (kernels_reslin_triton_wy, kernels_reslin_triton_state,
                                      kernels_reslin_triton_output, kernels_reslin_triton_backward)
           for name, value in vars(module).items() if isinstance(value, kernels_reslin_triton_launch._Launcher)}
SHARED_MEMORY = 232448
DTYPES = {"bf16": (tl.bfloat16, "*bf16"), "fp16": (tl.float16, "*fp16"), "fp32": (tl.float32, "*fp32")}
INDEX_POINTERS = ("cu_seqlens_ptr", "chunk_seq_ptr", "chunk_offsets_ptr")
# Pointers to the states, the gates and the fp32 gradient buffers; the others hold inputs or
# buffers in the input dtype (dq, dk and dv too: GROUP is 1 here).
FP32_POINTERS = ("S_ptr", "R_ptr", "G_ptr", "state_ptr", "S0_ptr", "R0_ptr", "ends_ptr", "starts_ptr",
                 "segment_decay_ptr", "chunk_decay_ptr", "row_factors_ptr", "chunk_factors_ptr", "g_ptr",
                 "strength_ptr", "residual_strength_ptr", "gamma_ptr", "dS_ptr", "dS0_ptr", "dR_ptr", "residual_ptr",
                 "dg_ptr", "dstrength_ptr", "dgamma_ptr", "dresidual_strength_ptr", "parts_ptr")


def compile_variant(fn, constexprs, pointer_type, num_warps, num_stages, head_size, maxnreg=None):
    """Specialised as a launch specialises (16-byte aligned pointers, integers that are multiples
    of 16 marked so, integers equal to 1 made constants), for B2 x T4096, H = HV = 16: the
    specialisation changes the tiles' layouts, and with them the shared memory."""
    params = list(inspect.signature(fn.kernel.fn).parameters)
    sizes = dict(T=4096, NT=64, L=8192, HV=16, GROUP=1, DK=head_size, DV=head_size)
    constexprs = {**{k: v for k, v in sizes.items() if v == 1 and k in params}, **constexprs}
    signature = {}
    for name in params:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in INDEX_POINTERS:
            signature[name] = "*i64"
        elif name in FP32_POINTERS:
            signature[name] = "*fp32"
        elif name.endswith("_ptr"):
            signature[name] = pointer_type
        else:
            signature[name] = "fp32" if name in ("scale", "clip") else "i64" if name == "T" else "i32"
    aligned = [name for name in params if name.endswith("_ptr") or sizes.get(name, 1) % 16 == 0 and name in sizes]
    return compile_for_sm90(fn, signature, constexprs, aligned, num_warps, num_stages, maxnreg)


def compile_for_sm90(fn, signature, constexprs, aligned, num_warps, num_stages, maxnreg=None):
    """`maxnreg`: the launch's register cap, None for none."""
    params = list(inspect.signature(fn.kernel.fn).parameters)
    source = ASTSource(fn=fn.kernel, signature=signature,
                       constexprs={(params.index(name),): value for name, value in constexprs.items()},
                       attrs={(params.index(name),): [["tt.divisibility", 16]] for name in aligned
                              if name not in constexprs})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages, "maxnreg": maxnreg})


# The fused layer kernels: activations in the input dtype, fp32 weights (autocast keeps the
# parameters fp32), fp32 gradient buffers, int64 positions. An absent optional pointer is None,
# a constexpr, as a launch passes it.
LAYER_FP32_POINTERS = ("weight_ptr", "dpre_ptr", "dweight_ptr", "A_log_ptr", "dt_bias_ptr", "g_ptr", "beta_ptr",
                       "gamma_ptr", "gamma_write_ptr", "S_ptr", "R_ptr")


def layer_launches():
    """(kernel, constexprs, pointers passed as None, num_warps), as the host code launches them."""
    conv, warps = dict(K=4, BT=layer_kernels.CONV_BLOCK_T), layer_kernels.NUM_WARPS
    backward_conv = dict(conv, BT=layer_kernels.CONV_BACKWARD_BLOCK_T)
    variants = []
    for BLOCK_N in (128, 1024):
        for gated in (False, True):
            blocks = dict(BLOCK_M=layer_kernels.TILE_ELEMENTS // BLOCK_N, BLOCK_N=BLOCK_N, GATED=gated)
            absent = () if gated else ("gate_ptr", "dgate_ptr")
            variants += [(layer_kernels._rms_norm_forward_kernel, blocks, absent, warps),
                         (layer_kernels._rms_norm_backward_kernel, blocks, absent, warps)]
    variants += [(fn, dict(BLOCK=layer_kernels.TILE_ELEMENTS), (), warps)
                 for fn in (layer_kernels._swiglu_forward_kernel, layer_kernels._swiglu_backward_kernel)]
    # The gates: a generation step's few elements, and a prefill's many.
    variants += [(layer_kernels._gates_kernel, dict(BLOCK=block, HAS_GAMMA=has_gamma), (), gates_warps)
                 for block, gates_warps in map(layer_kernels.gates_launch, (1, 2 ** 20)) for has_gamma in (False, True)]
    for has_positions in (False, True):
        absent_positions = () if has_positions else ("positions_ptr",)
        variants.append((layer_kernels._short_conv_input_grad_kernel,
                         dict(conv, BD=layer_kernels.CONV_BLOCK_D, HAS_POSITIONS=has_positions), absent_positions,
                         warps))
        for has_state in (False, True):
            for normalize in (False, True):
                flags = dict(BD=layer_kernels.CONV_BLOCK_D, HAS_STATE=has_state, HAS_POSITIONS=has_positions,
                             NORMALIZE=normalize)
                absent = absent_positions + (() if has_state else ("state_ptr",))
                variants += [(layer_kernels._short_conv_forward_kernel, dict(conv, **flags, UPDATE_STATE=update), absent,
                              warps) for update in ((False, True) if has_state else (False,))]
                variants.append((layer_kernels._short_conv_backward_kernel, dict(backward_conv, **flags), absent, warps))
    # A generation step's decode kernel on the in-projection's output (projected_decode_step), every
    # rule's flags, heads of 128 and 256, on its DECODE_WARPS; under PDL with the states
    # loaded before the wait, as the model's step launches it, and after.
    for head_size in (128, 256):
        BK, BV = decode_kernels._state_tile(head_size, head_size)
        variants += [(decode_kernels._projected_decode_step_kernel,
                      dict(BK=BK, BV=BV, DELTA=delta, RESIDUAL=residual, KACZMARZ=kaczmarz, PDL=pdl, PRELOAD=preload),
                      (), decode_kernels.DECODE_WARPS)
                     for delta, kaczmarz in ((False, False), (True, False), (True, True))
                     for residual in (False, True) for pdl, preload in ((False, False), (True, False), (True, True))]
    return variants


def compile_layer_variant(fn, constexprs, absent, pointer_type, num_warps):
    params = list(inspect.signature(fn.kernel.fn).parameters)
    constexprs = {**constexprs, **{name: None for name in absent if name in params}}
    signature = {name: "constexpr" if name in constexprs else
                 "*i64" if name == "positions_ptr" else
                 "*fp32" if name in LAYER_FP32_POINTERS else
                 pointer_type if name.endswith("_ptr") else
                 "fp32" if name.endswith("eps") or name in ("scale", "clip") else "i32" for name in params}
    aligned = [name for name in params if name.endswith("_ptr")]
    return compile_for_sm90(fn, signature, constexprs, aligned, num_warps, num_stages=3)


# A generation step's products (kernels_reslin_triton_gemv) at the 400M and 1.3B shapes (hidden
# 1024 and 2048, heads of 128, SwiGLU 2816 and 5632): (entry point, K, N, norm, head_dim, SwiGLU,
# residual, the short convolutions' taps). The in-projection's N: q, k, v and g of the hidden width,
# and a, b and gamma of one value a head; its q, k and v through convolutions of 4 taps.
GEMV_SHAPES = [(name, K, N, norm, head_dim, swiglu, residual, conv_size)
               for hidden, heads, inner in ((1024, 8, 2816), (2048, 16, 5632))
               for name, K, N, norm, head_dim, swiglu, residual, conv_size in (
                   ("rms_norm_linear", hidden, 4 * hidden + 3 * heads, "row", None, False, False, 4),
                   ("gated_rms_norm_linear", hidden, hidden, "gated_heads", 128, False, True, 0),
                   ("rms_norm_swiglu", hidden, inner, "row", None, True, False, 0),
                   ("linear_residual", inner, hidden, "none", None, False, True, 0))]


def gemv_config(M, K, N, norm, head_dim, swiglu, residual, conv_size, dtype, split):
    """gemv_kernels.gemv_config for these, with split counters given and, where `split`, K split
    at every row count of the tl.dot path (else at none)."""
    with unittest.mock.patch.object(gemv_kernels, "SPLIT_K_MAX_ROWS", 2**62 if split else 0):
        return gemv_kernels.gemv_config(M, N, K, DTYPES[dtype][0].primitive_bitwidth // 8, norm, head_dim, swiglu,
                                        residual, conv_size, can_split=True)


def compile_gemv_variant(M, K, N, norm, head_dim, swiglu, residual, conv_size, dtype, pdl, split):
    """`_gemv_kernel` as `kernels_reslin_triton_gemv` launches it for M contiguous rows: every
    tensor in the input's dtype (a model's norm weights too), integers specialised as a launch
    specialises them (equal to 1: a constant; multiples of 16 marked so)."""
    fn = gemv_kernels._gemv_kernel
    params = list(inspect.signature(fn.kernel.fn).parameters)
    pointer_type = DTYPES[dtype][1]
    K_span, constexprs, warps, stages, splits, split_span = gemv_config(M, K, N, norm, head_dim, swiglu, residual,
                                                                        conv_size, dtype, split)
    present = dict(gate_ptr=norm == "gated_heads", norm_weight_ptr=norm != "none", up_weight_ptr=swiglu,
                   residual_ptr=residual, partials_ptr=constexprs["SPLIT"], counters_ptr=constexprs["SPLIT"],
                   **{f"{x}_{part}_ptr": conv_size > 0 for x in "qkv" for part in ("state", "taps")})
    sizes = dict(M=M, N=N, K=K, K_SPAN=K_span, x_stride=K, gate_stride=K if norm == "gated_heads" else 0,
                 residual_stride=N if residual else 0, KEY_WIDTH=K if conv_size else 0,
                 VALUE_WIDTH=K if conv_size else 0, SPLITS=splits, SPLIT_SPAN=split_span)
    constexprs = {**constexprs, "PDL": pdl, "PRELOAD": pdl, **{name: None for name, here in present.items() if not here},
                  **{name: 1 for name, size in sizes.items() if size == 1}}
    pointer_types = dict(partials_ptr="*fp32", counters_ptr="*i32")
    signature = {name: "constexpr" if name in constexprs else pointer_types.get(name, pointer_type)
                 if name.endswith("_ptr") else "fp32" if name == "eps" else "i32" for name in params}
    aligned = [name for name in params if name.endswith("_ptr") or sizes.get(name, 1) % 16 == 0]
    return compile_for_sm90(fn, signature, constexprs, aligned, warps, stages), constexprs, warps, stages


def choice_variants(pointer_type):
    """(label, compile) of the greedy choice's two kernels (kernels_reslin_triton_choice) as
    greedy_choice launches them for logits of pointer_type: without and with minimum lengths and
    end-of-sequence ids, for one and sixteen rows of a 32000-column vocabulary, under PDL (the
    code without it is the same less the wait)."""
    parts = -(-32000 // choice_kernels.PART_COLUMNS)
    argmax = choice_kernels._part_argmax_kernel
    bookkeeping = choice_kernels._bookkeeping_kernel
    variants = []
    for n in (0, 2):
        signature = dict(logits_ptr=pointer_type, row_stride="i32", V="i32", masked_ids_ptr="*i64",
                         masked_until_ptr="*i64", position_ptr="*i64", part_value_ptr="*fp32", part_index_ptr="*i64",
                         PARTS="i32", N_MASKED="constexpr", BLOCK="constexpr", PDL="constexpr")
        variants.append((f"_part_argmax_kernel            {pointer_type} N_MASKED={n} PDL", lambda n=n, signature=signature:
                         compile_for_sm90(argmax, signature, dict(N_MASKED=n, BLOCK=choice_kernels.PART_COLUMNS,
                                                                  PDL=True),
                                          [name for name in signature if name.endswith("_ptr")], 4, 1)))
    for n_eos in (0, 2):
        for rows in (1, 16):
            signature = dict(part_value_ptr="*fp32", part_index_ptr="*i64", PARTS="i32", B="i32", eos_ids_ptr="*i64",
                             pad_id_ptr="*i64", unfinished_ptr="*i1", sequences_ptr="*i64", sequences_stride="i32",
                             any_unfinished_ptr="*i1", token_ptr="*i64", position_ptr="*i64", N_EOS="constexpr",
                             BLOCK_B="constexpr", BLOCK_P="constexpr", PDL="constexpr")
            constexprs = dict(N_EOS=n_eos, BLOCK_B=rows, BLOCK_P=1 << (parts - 1).bit_length(), PDL=True)
            variants.append((f"_bookkeeping_kernel            N_EOS={n_eos} BLOCK_B={rows} PDL",
                             lambda signature=signature, constexprs=constexprs: compile_for_sm90(
                                 bookkeeping, signature, constexprs, [n for n in signature if n.endswith("_ptr")], 4, 1)))
    return variants


def registers(compiled):
    """ptxas's register and spill report for the compiled variant (Triton bundles ptxas), e.g.
    "117 registers, 0 bytes spill stores": spills cost local-memory traffic in a hot loop."""
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as folder:
        ptx = os.path.join(folder, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        report = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", ptx, "-o", os.devnull],
                                capture_output=True, text=True, check=True).stderr
    used = re.search(r"Used (\d+) registers", report).group(1)
    spilled = re.search(r"(\d+) bytes spill stores", report).group(1)
    return f"{used} registers, {spilled} B spilled"


def report(label, compile_it, registers_too):
    """Compile one variant and print its line: 1 if it does not compile or its shared memory does
    not fit, else 0 (every variant is reported, then the run fails)."""
    start = time.time()
    try:
        compiled = compile_it()
    except Exception as error:
        print(f"{label}: does not compile: {str(error).splitlines()[0][:300]}", flush=True)
        return 1
    shared = compiled.metadata.shared
    fits = shared <= SHARED_MEMORY
    extra = f", {registers(compiled)}" if registers_too else ""
    print(f"{label}: {shared:6d} B shared{'' if fits else ' > ' + str(SHARED_MEMORY)}{extra}"
          f" ({time.time() - start:.0f} s)", flush=True)
    return int(not fits)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-sizes", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=sorted(DTYPES))
    parser.add_argument("--registers", action="store_true", help="also ptxas's registers and spills per variant")
    parser.add_argument("--layers-only", action="store_true", help="only the fused layer kernels")
    parser.add_argument("--gemv-only", action="store_true", help="only the generation step's GEMV kernels")
    parser.add_argument("--cap", action="append", default=[], metavar="KERNEL=N",
                        help="compile KERNEL (e.g. _chunk_wy_kernel) at N registers, in place of its launch's cap")
    args = parser.parse_args()
    caps = {}
    for cap in args.cap:
        name, _, limit = cap.partition("=")
        if name not in KERNELS or not limit.isdigit():
            parser.error(f"--cap wants KERNEL=N with a chunked kernel ({', '.join(sorted(KERNELS))}), got {cap!r}")
        caps[name] = int(limit)
    failures = 0
    for dtype in args.dtypes:
        DT, pointer_type = DTYPES[dtype]
        for head_size in [] if args.layers_only or args.gemv_only else args.head_sizes:
            for delta in (True, False):
                for residual in (False, True):
                    for name, constexprs, warps, stages in tuning.launch_variants(head_size, head_size, delta,
                                                                                  residual, dtype == "fp32"):
                        fn = KERNELS[name]
                        params = inspect.signature(fn.kernel.fn).parameters
                        flags = dict(DT=DT, DELTA=delta, RESIDUAL=residual, VARLEN=False)
                        constexprs = {**constexprs, **{k: v for k, v in flags.items() if k in params}}
                        label = (f"{fn.kernel.fn.__name__:30s} {dtype} D{head_size} {'delta' if delta else 'additive'}"
                                 f"{' residual' if residual else ''}{' store_z' if constexprs.get('STORE_Z') else ''}"
                                 f"{' both_states' if constexprs.get('BOTH_STATES') else ''}"
                                 f"{' scan_g' if constexprs.get('SCAN_G') else ''}"
                                 f"{' from_inverse' if constexprs.get('WRITES_FROM_INVERSE') else ''}"
                                 f"{' keeping' if constexprs.get('KEPT_SEGMENT_CHUNKS') else ''}"
                                 f"{' dependent' if constexprs.get('DEPENDENT') else ''}"
                                 f"{' adds_to_state' if constexprs.get('ADDS_TO_STATE') else ''}"
                                 f"{' gated_read' if constexprs.get('GATED_READ') else ''}"
                                 f"{' pred' if constexprs.get('PRED') else ''}"
                                 f"{' side ' + str(constexprs['SIDE']) if constexprs.get('SIDE') else ''}"
                                 f"{' chunks of ' + str(constexprs['BC']) if constexprs.get('BC', 64) != 64 else ''}")
                        maxnreg = caps.get(name, tuning.register_cap(name, delta, residual, head_size,
                                                                     dtype == "fp32"))
                        failures += report(label, lambda: compile_variant(fn, constexprs, pointer_type, warps, stages,
                                                                          head_size, maxnreg), args.registers)
        for label, compile_choice in [] if args.gemv_only or dtype == "fp32" else choice_variants(pointer_type):
            failures += report(label, compile_choice, args.registers)
        for fn, constexprs, absent, warps in [] if args.gemv_only else layer_launches():
            flags = " ".join(f"{k}={v}" for k, v in constexprs.items()
                             if isinstance(v, bool) or k in ("BLOCK_N", "BK", "K"))
            label = f"{fn.kernel.fn.__name__:30s} {dtype} {flags}"
            failures += report(label, lambda: compile_layer_variant(fn, constexprs, absent, pointer_type, warps),
                               args.registers)
        for name, K, N, norm, head_dim, swiglu, residual, conv_size in GEMV_SHAPES:
            # PDL: programmatic_launch; split: K split at 4 and 16 rows (SPLIT_K_MAX_ROWS)
            for M, pdl, split in itertools.product((1, 4, 16), (False, True), (False, True)):
                constexprs, warps, stages, splits = gemv_config(M, K, N, norm, head_dim, swiglu, residual, conv_size,
                                                                dtype, split)[1:5]
                if split and not constexprs["SPLIT"]:
                    continue  # the launch does not split here: the variant without is the same
                blocks = " ".join(f"{k}={constexprs[k]}" for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SWAP_AB"))
                split_text = f" splits={splits}" if split else ""
                label = (f"_gemv_kernel {name:22s} {dtype} M{M} K{K} N{N} {blocks} warps={warps} stages={stages}"
                         f"{split_text}{f' conv {conv_size}' if conv_size else ''}{' PDL' if pdl else ''}")
                failures += report(label, lambda: compile_gemv_variant(M, K, N, norm, head_dim, swiglu, residual,
                                                                       conv_size, dtype, pdl, split)[0], args.registers)
    print(f"{failures} variant(s) failed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
