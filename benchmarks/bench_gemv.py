"""A generation step's projections: the fused GEMV kernels (kernels_reslin_triton_gemv.py) against
the unfused step (`modeling_reslin.FUSED_DECODE_STEP = False`), both replayed from CUDA graphs.

For each entry point, shape and batch it prints the time of one call as a generation step's CUDA
graph sees it: CALLS calls captured in one graph, the graph replayed, the time divided by the
calls, so that launch gaps count and the host's time does not. The unfused path is what
modeling_reslin runs at a decode step: the fused rms_norm kernel (with its projections for the
MLP and the gated output norm), F.linear, the SwiGLU kernel, the residual add; the in-projection's
weights side by side, as the cache keeps them (`ResLinCache.side_by_side_weight`), its q, k and v
through their short convolutions of 4 taps with their windows moved along (ours in the product's
epilogue; unfused, the three `short_convolution` kernels, here without their L2 norm of q and k,
which the fused step forms in the decode kernel). Beside the times:
the weight bytes read per call over the time (GB/s, the roofline being the H200's ~4.3 TB/s), the
ratio ours / unfused, and ours' relative error against the unfused output (bf16: ~1e-3 or less,
the two rounding at the same points).

The calls cycle through enough copies of the weights to pass the GPU's L2 cache (about 50 MB on
an H200) twice, as a model's layers do (a graph takes as many calls as there are copies, if more
than CALLS): one matrix read again and again would stay in L2 and time its bandwidth, not HBM's.

    python benchmarks/bench_gemv.py [--shapes 400M 1.3B] [--rows 1 4 16] [--calls 50] [--pdl] [--split]
    python benchmarks/bench_gemv.py --sweep --shapes 400M --rows 1 16 --calls 20 --replays 10 \
        --entry-points rms_norm_linear gated_rms_norm_linear   # other tiles, to tune gemv_launch
    python benchmarks/bench_gemv.py --smoke   # tiny sizes on a CPU (Triton's interpreter): checks the script runs

--sweep times ours under other launch tiles (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, swap_ab,
splits of K) besides gemv_launch's own pick, fastest first: what to change in gemv_launch. Ours and
the sweep run without programmatic dependent launch; --pdl times ours again under it, in a column
of its own; --split times ours again with K split where the tiles are few, at every row count
(kernels_reslin_triton_gemv.SPLIT_K_MAX_ROWS; ours is given split counters, as a model's step).
"""

import argparse

import torch
import torch.nn.functional as F

from common import DEVICE, DTYPE, copies_past_l2, print_header, programmatic_launch, split_k, us_per_call
import kernels_reslin_triton_gemv as gemv
import kernels_reslin_triton_launch as triton_launch
import kernels_reslin_triton_layers as layers

EPS = 1e-6
CONV_TAPS = 4
# (hidden, heads of 128, SwiGLU width): the in-projection's rows are q, k, v and g of the hidden
# width and a, b and gamma of one value a head.
SHAPES = {"400M": (1024, 8, 2816), "1.3B": (2048, 16, 5632), "smoke": (32, 2, 48)}
# Each entry point's norm, as `_gemv_kernel` names it.
ENTRY_POINTS = {"rms_norm_linear": "row", "gated_rms_norm_linear": "gated_heads", "rms_norm_swiglu": "row",
                "linear_residual": "none"}


def problem(name, hidden, heads, inner):
    """(K, N, head_dim) of an entry point in a block of this shape."""
    return {"rms_norm_linear": (hidden, 4 * hidden + 3 * heads, None),
            "gated_rms_norm_linear": (hidden, hidden, hidden // heads),
            "rms_norm_swiglu": (hidden, inner, None),
            "linear_residual": (inner, hidden, None)}[name]


def launch(name, rows, K, N, head_dim):
    """gemv_launch's pick for this call, (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, swap_ab, splits),
    and the (K_span, group_block) it was picked for."""
    K_span, blocks, warps, stages, splits, _ = gemv.gemv_config(rows, N, K, DTYPE.itemsize, ENTRY_POINTS[name],
                                                                head_dim, name == "rms_norm_swiglu",
                                                                name.endswith("residual"), can_split=True)
    tile = (blocks["BLOCK_M"], blocks["BLOCK_N"], blocks["BLOCK_K"], warps, stages, blocks["SWAP_AB"], splits)
    return tile, K_span, blocks["GROUP_BLOCK"] if head_dim else 1


def calls(name, rows, K, N, weights, head_dim, weight_bytes):
    """(ours, unfused, ours' relative error against unfused, copies): two callables each making the
    next call of a cycle over copies of the weights that pass the L2 cache twice
    (common.copies_past_l2), on one step's inputs [rows, 1, K]; the error taken on one copy."""
    gen = torch.Generator(device=DEVICE).manual_seed(0)

    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, device=DEVICE, generator=gen)).to(DTYPE)

    x, residual = randn(rows, 1, K), randn(rows, 1, N)
    gate = randn(rows, 1, K + 24)[..., 24:]  # a column slice, as the in-projection's output gives it
    norm_weight = 1 + randn(head_dim or K, scale=0.3)
    next_weights, copies = copies_past_l2(lambda: [randn(N, K, scale=K ** -0.5) for _ in range(weights)],
                                          weight_bytes)
    heads = (rows, 1, K // head_dim, head_dim) if head_dim else None
    counters = torch.zeros(1024, dtype=torch.int32, device=DEVICE)  # as a model's cache gives them
    # The in-projection's q, k and v, each of the hidden width K: their taps, and windows for each path.
    taps = [randn(K, 1, CONV_TAPS, scale=0.5) for _ in range(3)]
    our_windows = [randn(rows, K, CONV_TAPS - 1) for _ in range(3)]
    unfused_windows = [w.clone() for w in our_windows]

    def ours(w):
        if name == "rms_norm_linear":
            return gemv.rms_norm_linear(x, norm_weight, EPS, *w, convolutions=(taps, our_windows),
                                        split_counters=counters)
        if name == "rms_norm_swiglu":
            return gemv.rms_norm_swiglu(x, norm_weight, EPS, *w, split_counters=counters)
        if name == "gated_rms_norm_linear":
            return gemv.gated_rms_norm_linear(x, gate, norm_weight, EPS, head_dim, *w, residual,
                                              split_counters=counters)
        return gemv.linear_residual(x, *w, residual, split_counters=counters)

    def unfused(w):
        if name == "rms_norm_linear":
            y = F.linear(layers.rms_norm(x, norm_weight, EPS), *w)
            convolved = [layers.short_convolution(y[..., i * K:(i + 1) * K], tap, window, update_state=True)
                         for i, (tap, window) in enumerate(zip(taps, unfused_windows))]
            return torch.cat([*convolved, y[..., 3 * K:]], dim=-1)
        if name == "rms_norm_swiglu":
            return layers.swiglu(*layers.rms_norm(x, norm_weight, EPS, projections=w)).view(rows, 1, N)
        if name == "gated_rms_norm_linear":  # ResLinGatedRMSNorm with o_proj as its projection, the residual add
            o, = layers.rms_norm(x.view(heads), norm_weight, EPS, gate.view(heads), w)
            return residual + o.view(rows, 1, N)
        return residual + F.linear(x, *w)
    w = next_weights()
    error = rel_err(ours(w), unfused(w))
    return lambda: ours(next_weights()), lambda: unfused(next_weights()), error, copies


def rel_err(x, ref):
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def sweep_tiles(rows, N, K_span, group_block, weights):
    """Launch tiles to try besides gemv_launch's: (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages,
    swap_ab, splits). From two rows on, the one-row tiles too, a program a row (the weight read
    once from memory, and from L2 for the other rows), row tiles of 2, 4 or 8 rows a program (the
    broadcast product of those rows, the weight read once for them), tl.dot tiles of K in one or two chunks
    (loaded in one round, as a row's) or in short chunks 6 or 8 stages deep, the transposed
    product (swap_ab) with wide weight tiles, and K split in 2, 4 or 8 where it has that many
    chunks."""
    K_block = max(16, 1 << (K_span - 1).bit_length())
    tiles = [(1, n, k, w, 1, False, 1) for n in (1, 2, 4, 8) for k in (512, 1024, 2048, 4096) for w in (4, 8)
             if k <= K_block and n * k * weights <= 16384]
    if rows > 1:
        tiles += [(m, n, k, w, 1, False, 1) for m in (2, 4, 8) for n in (1, 2, 4) for k in (256, 512, 1024, 2048)
                  for w in (4, 8) if m <= rows and k <= K_block and m * n * k * weights <= 8192 * w // 4]
        tiles += [(16, n, k, 4, s, False, 1) for n in (16, 32, 64) for k in (64, 128, 256) for s in (2, 3, 4)
                  if k <= K_block and n * k * weights <= 8192]
        tiles += [(16, n, k, w, s, False, 1) for n in (16, 32) for k in (512, 1024, 2048) for w in (4, 8)
                  for s in (1, 2) if k <= K_block and 8192 < n * k * weights <= 32768]  # K in one or two rounds
        tiles += [(16, n, k, 4, s, False, 1) for n in (16, 32) for k in (64, 128) for s in (6, 8)
                  if k <= K_block and n * k * weights <= 8192]  # most of K in flight through shared memory
        tiles += [(16, n, k, 4, s, True, 1) for n in (64, 128) for k in (32, 64, 128) for s in (3, 4, 6)
                  if k <= K_block and n * k * weights <= 16384]
        tiles += [(16, n, k, 4, s, False, p) for n in (16, 32, 64) for k in (64, 128, 256) for s in (3, 4)
                  for p in (2, 4, 8) if n * k * weights <= 8192 and p <= -(-K_span // k)]
    return [tile for tile in tiles if tile[2] >= group_block]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["400M", "1.3B"], choices=sorted(SHAPES))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16], help="tokens a step (the batch)")
    parser.add_argument("--entry-points", nargs="+", default=list(ENTRY_POINTS), choices=ENTRY_POINTS)
    parser.add_argument("--calls", type=int, default=50,
                        help="calls captured in one CUDA graph (at least one a copy of the weights)")
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--sweep", action="store_true", help="also ours under other launch tiles")
    parser.add_argument("--pdl", action="store_true",
                        help="ours also under programmatic dependent launch (kernels_reslin_triton_launch."
                             "PROGRAMMATIC_LAUNCH_MAX_ROWS, here for every row count): a column 'PDL us'; "
                             "the other columns are without it")
    parser.add_argument("--split", action="store_true",
                        help="ours also with K split where the tiles are few (kernels_reslin_triton_gemv."
                             "SPLIT_K_MAX_ROWS, here for every row count): a column 'split us' and its tile")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, a call a replay (for a CPU)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.shapes, args.calls, args.replays = ["smoke"], 1, 1
    elif DEVICE != "cuda":
        parser.error("times a GPU's CUDA graphs: on a CPU only --smoke runs")
    print_header(f"fused GEMV products against the unfused path, {DTYPE}, {args.calls} calls a CUDA graph")
    print(f"{'entry point':22} {'shape':5} {'rows':>4} {'ours us':>8} {'GB/s':>6} {'unfused us':>10} {'GB/s':>6} "
          f"{'ratio':>6} {'rel err':>8}{' PDL us' if args.pdl else ''}{' split us' if args.split else ''}  "
          f"ours' tile (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, swap_ab, splits)")
    # Ours and the sweep without PDL at any batch size (each kernel alone), the PDL column with it.
    with torch.no_grad(), programmatic_launch(triton_launch, False):
        for shape in args.shapes:
            hidden, heads, inner = SHAPES[shape]
            for name in args.entry_points:
                K, N, head_dim = problem(name, hidden, heads, inner)
                weights = 2 if name == "rms_norm_swiglu" else 1
                for rows in args.rows:
                    weight_bytes = weights * N * K * DTYPE.itemsize
                    ours, unfused, error, copies = calls(name, rows, K, N, weights, head_dim, weight_bytes)
                    count = max(args.calls, copies)  # every replay reads every copy
                    ours_us = us_per_call(ours, count, args.replays)
                    unfused_us = us_per_call(unfused, count, args.replays)
                    pdl_text = split_text = split_tile = ""
                    if args.pdl:
                        with programmatic_launch(triton_launch):
                            pdl_text = f" {us_per_call(ours, count, args.replays):6.2f}"
                    tile, K_span, group_block = launch(name, rows, K, N, head_dim)
                    if args.split:
                        with split_k(gemv):
                            split_text = f" {us_per_call(ours, count, args.replays):8.2f}"
                            split_tile = f", split {launch(name, rows, K, N, head_dim)[0]}"
                    print(f"{name:22} {shape:5} {rows:4d} {ours_us:8.2f} {weight_bytes / ours_us / 1e3:6.0f} "
                          f"{unfused_us:10.2f} {weight_bytes / unfused_us / 1e3:6.0f} {ours_us / unfused_us:6.2f} "
                          f"{error:8.1e}{pdl_text}{split_text}  {tile}{split_tile}", flush=True)
                    if args.sweep:
                        sweep(ours, tile, rows, N, K_span, group_block, weights, weight_bytes, count, args)


def sweep(ours, pick, rows, N, K_span, group_block, weights, weight_bytes, count, args):
    """Ours under each other tile (gemv_launch replaced for the call), fastest first, the pick
    marked; a tile that does not compile or fit is named with its error."""
    results = []
    for tile in [pick] + [t for t in sweep_tiles(rows, N, K_span, group_block, weights) if t != pick]:
        original = gemv.gemv_launch
        gemv.gemv_launch = lambda *_, tile=tile: tile
        try:
            results.append((us_per_call(ours, count, args.replays), tile))
        except Exception as error:  # a tile past the shared memory or the registers: the others still run
            print(f"    {tile}: {type(error).__name__}: {str(error).splitlines()[0][:120]}")
        finally:
            gemv.gemv_launch = original
    ranked = sorted(results)
    for rank, (us, tile) in enumerate(ranked):
        if rank < 8 or tile == pick:
            mark = f"  <- gemv_launch's pick, {rank + 1} of {len(ranked)}" if tile == pick else ""
            print(f"    {us:8.2f} us {weight_bytes / us / 1e3:6.0f} GB/s  {tile}{mark}")


if __name__ == "__main__":
    main()
