"""The generation step's fused products (kernels_reslin_triton_gemv.py) against an fp32 reference
and against the unfused composition the model runs today (its norm modules, nn.Linear, SwiGLU, the
residual add).

Without a GPU they run in Triton's CPU interpreter in fp32: relative error <= 1e-5 against both
(both compute in fp32; only the order of the sums differs). Rows 1 (the one-row path) and 3, 16
and 17 (the tl.dot path, 17 in two row tiles; the gated norm's 3 rows a program a row), K and N that fill no block, heads of 48 (masked
lanes) and 128, leading dims [B, 1, K]; each with the launch's own blocks, with small ones
that split K into several chunks and put many outputs in a program, with the tl.dot path's
transposed product (weight @ x.T), with K split among programs (each launch checked to leave
its split counters at zero), and with row tiles (a few rows' broadcast product) in its place.

On the GPU (`pytest -m gpu`) the kernels run compiled in bf16 at a 400M model's shapes for 1, 4
and 16 rows: relative error <= 1e-2 against the fp32 reference (bf16 rounding of the normed input,
the product and the epilogue) and at most 1e-3 above the unfused bf16 path's own (the existing
fused norm and SwiGLU kernels, F.linear and the residual add), and <= 4e-3, one bf16 rounding,
against that path: it rounds at the same points, so the two differ only where sums taken in
another order (cuBLAS may reduce split-K parts in bf16) round to different bf16 neighbours.
"""

import re
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from test_kernels import rel_err

gemv = pytest.importorskip("kernels_reslin_triton_gemv", reason="needs the triton package")
layers = pytest.importorskip("kernels_reslin_triton_layers", reason="needs the triton package")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6
REPO = Path(__file__).resolve().parents[1]


def on_gpu(test):
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")(test))


@pytest.fixture(params=["launch blocks", "small blocks", "swapped products", "split K", "row tiles"])
def blocks(request, monkeypatch):
    """The launch's own blocks, or small ones: several chunks along K on both paths (a one-row
    chunk of 128 positions; a tl.dot chunk of 32 in fp32, 16 for SwiGLU, or one head) and as many
    outputs a program as the tile allows (then N's last block is part empty); or the tl.dot path's
    transposed product, weight @ x.T; or K split among as many programs as it has chunks of 32
    (16 for SwiGLU, a head for the gated norm) at every row count of the tl.dot path; or, in
    place of the tl.dot path, row tiles (the broadcast product of a few rows, which bench_gemv.py
    --sweep ranks) of 4 rows and 4 outputs a program, over chunks of 64 positions or a head."""
    if request.param in ("small blocks", "split K"):
        monkeypatch.setattr(gemv, "MAX_BLOCK_K", 128)
        monkeypatch.setattr(gemv, "DOT_BLOCK_K", 64)
        monkeypatch.setattr(gemv, "PROGRAMS_TO_FILL", 1 if request.param == "small blocks" else 2**20)
    if request.param == "split K":
        monkeypatch.setattr(gemv, "SPLIT_K_MAX_ROWS", 2**20)
        monkeypatch.setattr(gemv, "SPLIT_K_MAX_TILES", 2**20)
    if request.param == "swapped products":
        monkeypatch.setattr(gemv, "DOT_SWAP_AB", True)
    if request.param == "row tiles":
        launch = gemv.gemv_launch

        def row_tiles(M, N, K_span, group_block, *args):
            return launch(M, N, K_span, group_block, *args) if M == 1 else (4, 4, max(64, group_block), 4, 1, False, 1)
        monkeypatch.setattr(gemv, "gemv_launch", row_tiles)
    return request.param


def counted(call, *args, **kwargs):
    """call(*args, split_counters=fresh zeros, **kwargs), checking that the launch left them zero."""
    counters = torch.zeros(1024, dtype=torch.int32, device=DEVICE)  # as many as a cache's
    y = call(*args, split_counters=counters, **kwargs)
    assert not counters.any(), "a launch must leave its split counters at zero"
    return y


def rms_norm64(x, weight, eps=EPS):
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


def gated_head_norm64(o, gate, weight, head_dim):
    heads = rms_norm64(o.unflatten(-1, (-1, head_dim)), weight).flatten(-2)
    return heads * F.silu(gate.double())


def fp32_reference(name, inputs, head_dim=None):
    """What each entry point computes, in float64 without any rounding in between."""
    if name == "rms_norm_linear":
        x, norm_weight, weight = inputs
        return rms_norm64(x, norm_weight) @ weight.double().T
    if name == "rms_norm_swiglu":
        x, norm_weight, gate_weight, up_weight = inputs
        xn = rms_norm64(x, norm_weight)
        return F.silu(xn @ gate_weight.double().T) * (xn @ up_weight.double().T)
    if name == "gated_rms_norm_linear":
        o, gate, norm_weight, weight, residual = inputs
        return residual.double() + gated_head_norm64(o, gate, norm_weight, head_dim) @ weight.double().T
    x, weight, residual = inputs
    return residual.double() + x.double() @ weight.double().T


def fused(name, inputs, head_dim=None):
    """The entry point on `inputs`, given split counters (used where the launch splits K)."""
    if name == "rms_norm_linear":
        x, norm_weight, weight = inputs
        return counted(gemv.rms_norm_linear, x, norm_weight, EPS, weight)
    if name == "rms_norm_swiglu":
        x, norm_weight, gate_weight, up_weight = inputs
        return counted(gemv.rms_norm_swiglu, x, norm_weight, EPS, gate_weight, up_weight)
    if name == "gated_rms_norm_linear":
        o, gate, norm_weight, weight, residual = inputs
        return counted(gemv.gated_rms_norm_linear, o, gate, norm_weight, EPS, head_dim, weight, residual)
    return counted(gemv.linear_residual, *inputs)


def unfused(reslin, name, inputs, head_dim=None, fused_layers=False):
    """The composition the model runs today: its norm modules (fused_layers: their Triton kernels,
    as on CUDA) and nn.Linear's F.linear, SwiGLU (the Triton kernel with fused_layers), the
    residual add of two tensors of the input's dtype."""
    modeling = reslin.modeling
    if name == "gated_rms_norm_linear":
        o, gate, norm_weight, weight, residual = inputs
        norm = modeling.ResLinGatedRMSNorm(head_dim, eps=EPS, fused=fused_layers).to(o.device, o.dtype)
        norm.weight.data.copy_(norm_weight)
        o_proj = torch.nn.Linear(o.shape[-1], weight.shape[0], bias=False).to(o.device, o.dtype)
        o_proj.weight.data.copy_(weight)
        heads = o.unflatten(-1, (-1, head_dim))
        projected, = norm(heads, gate.unflatten(-1, (-1, head_dim)), (o_proj,))
        return residual + projected
    if name == "linear_residual":
        x, weight, residual = inputs
        return residual + F.linear(x, weight)
    x, norm_weight, *weights = inputs
    norm = modeling.ResLinRMSNorm(x.shape[-1], eps=EPS, fused=fused_layers).to(x.device, x.dtype)
    norm.weight.data.copy_(norm_weight)
    xn = norm(x)
    if name == "rms_norm_linear":
        return F.linear(xn, weights[0])
    gate, up = (F.linear(xn, w) for w in weights)
    return layers.swiglu(gate, up) if fused_layers else F.silu(gate) * up


def make_inputs(name, lead, K, N, head_dim=None, dtype=torch.float32, device=DEVICE, seed=0):
    """Random inputs of entry point `name`: activations [*lead, K] (or [*lead, N]), weights [N, K]
    scaled as an initialised model's, norm weights about 1. The gated norm's gate is a column
    slice of a wider tensor, as a generation step's gate comes out of the in-projection's GEMM."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0, mean=0.0):
        return (mean + scale * torch.randn(*shape, generator=gen)).to(device, dtype)

    def weight(rows=N):
        return randn(rows, K, scale=K ** -0.5)

    if name == "rms_norm_linear":
        return randn(*lead, K), randn(K, scale=0.3, mean=1.0), weight()
    if name == "rms_norm_swiglu":
        return randn(*lead, K), randn(K, scale=0.3, mean=1.0), weight(), weight()
    if name == "gated_rms_norm_linear":
        wide = randn(*lead, K + 40)
        return randn(*lead, K), wide[..., 24:24 + K], randn(head_dim, scale=0.3, mean=1.0), weight(), randn(*lead, N)
    return randn(*lead, K), weight(), randn(*lead, N)


ENTRY_POINTS = ["rms_norm_linear", "rms_norm_swiglu", "gated_rms_norm_linear", "linear_residual"]
# Leading dims (a decode step's [B, 1] and flat rows): 1 row (the one-row path), 3 and 16 (one
# tl.dot tile) and 17 (two).
LEADS = [(1, 1), (3, 1), (16,), (17,)]
# (K, N): neither a multiple of any block; K past one chunk of 128 and of 256, N past a program's
# outputs (the interpreter runs programs one by one: at most a few hundred a case).
SIZES = [(200, 300), (1000, 37)]
# (heads, head_dim) of the gated norm: 48 (64 lanes, 16 masked) and 128, N not a power of two.
HEADS = [(7, 48, 40), (3, 128, 100)]


def check(reslin, name, lead, K, N, head_dim=None):
    inputs = make_inputs(name, lead, K, N, head_dim)
    with torch.no_grad():
        y = fused(name, inputs, head_dim)
        expected = unfused(reslin, name, inputs, head_dim)
    assert y.shape == (*lead, N) and y.dtype == inputs[0].dtype
    assert rel_err(y, fp32_reference(name, inputs, head_dim)) <= 1e-5
    assert rel_err(y, expected) <= 1e-5


@pytest.mark.parametrize("lead", LEADS, ids=str)
@pytest.mark.parametrize("K,N", SIZES, ids=str)
@pytest.mark.parametrize("name", ["rms_norm_linear", "rms_norm_swiglu", "linear_residual"])
def test_products_match_the_reference(reslin, blocks, name, K, N, lead):
    check(reslin, name, lead, K, N)


@pytest.mark.parametrize("lead", LEADS, ids=str)
@pytest.mark.parametrize("heads,head_dim,N", HEADS, ids=str)
def test_gated_head_norm_product_matches_the_reference(reslin, blocks, heads, head_dim, N, lead):
    check(reslin, "gated_rms_norm_linear", lead, heads * head_dim, N, head_dim)


def short_convolutions(product, taps, states):
    """The q | k | v columns of `product` [B, 1, N] through short convolutions in float64 from
    `states` [B, D, C - 1]: (the product with them replaced, the states moved along by one input)."""
    out, moved, start = product.double().clone(), [], 0
    for tap, state in zip(taps, states):
        width = tap.shape[0]
        window = torch.cat([state.double(), product[:, 0, start:start + width, None].double()], dim=-1)
        out[:, 0, start:start + width] = F.silu((window * tap[:, 0].double()).sum(-1))
        moved.append(window[..., 1:])
        start += width
    return out, moved


# (B, q and k channels, v channels, columns after them, taps): one row, one tl.dot tile and two
# (17 rows), a window of 1 to 3 inputs, widths that fill no block.
CONVOLUTIONS = [(1, 6, 10, 5, 4), (3, 8, 12, 7, 3), (17, 4, 4, 3, 2), (2, 32, 48, 9, 4)]


@pytest.mark.parametrize("B,key_width,value_width,rest,C", CONVOLUTIONS, ids=str)
def test_in_projection_with_its_convolutions_matches_the_reference(blocks, B, key_width, value_width, rest, C):
    """rms_norm_linear with `convolutions`: the q, k and v outputs through their short convolutions
    from the product as returned (rounded to x's dtype), the other columns the plain product, and
    the states moved along by the product's q, k and v; relative error <= 1e-5 against float64
    in fp32 (bf16 on a GPU: 1e-2); the states exactly on a CPU (copies of the rounded product),
    within 1e-2 on a GPU."""
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    tolerance = 1e-5 if DEVICE == "cpu" else 1e-2
    with torch.device(DEVICE), torch.no_grad():
        torch.manual_seed(0)
        K, N = 40, 2 * key_width + value_width + rest
        x, norm_weight = torch.randn(B, 1, K, dtype=dtype), torch.randn(K, dtype=dtype)
        weight = (torch.randn(N, K) * K ** -0.5).to(dtype)
        widths = (key_width, key_width, value_width)
        taps = tuple((0.5 * torch.randn(width, 1, C)).to(dtype) for width in widths)
        states = tuple(torch.randn(B, width, C - 1, dtype=dtype) for width in widths)
        initial = tuple(state.clone() for state in states)
        y = counted(gemv.rms_norm_linear, x, norm_weight, EPS, weight, convolutions=(taps, states))
        product = counted(gemv.rms_norm_linear, x, norm_weight, EPS, weight)  # K split as above
        expected, moved = short_convolutions(product, taps, initial)
    assert y.shape == (B, 1, N) and y.dtype == dtype
    assert rel_err(y, expected) <= tolerance
    for state, want in zip(states, moved):
        assert rel_err(state, want) <= (0 if DEVICE == "cpu" else 1e-2)


def test_strided_rows_read_in_place():
    """x, gate and residual with rows further apart than their width (column slices of wider
    tensors) give what their contiguous copies give, to fp32's rounding (compiled, a stride that is
    no multiple of 16 loads in another layout, whose sums may run in another order); no rows gives
    no rows."""
    with torch.device(DEVICE):  # every tensor made here on the tested device
        torch.manual_seed(0)
        K, N, head_dim = 96, 24, 48
        wide_x, wide_gate, wide_residual = torch.randn(5, K + 8), torch.randn(5, K + 40), torch.randn(5, N + 3)
        x, gate, residual = wide_x[:, 8:], wide_gate[:, 40:], wide_residual[:, :N]
        norm_weight, head_weight, weight = torch.randn(K), torch.randn(head_dim), torch.randn(N, K)
        for call in (lambda x, g, r: gemv.rms_norm_linear(x, norm_weight, EPS, weight),
                     lambda x, g, r: gemv.rms_norm_swiglu(x, norm_weight, EPS, weight, weight.flip(0)),
                     lambda x, g, r: gemv.gated_rms_norm_linear(x, g, head_weight, EPS, head_dim, weight, r),
                     lambda x, g, r: gemv.linear_residual(x, weight, r)):
            copies = (x.contiguous(), gate.contiguous(), residual.contiguous())
            assert rel_err(call(x, gate, residual), call(*copies)) <= 1e-6
            assert call(x[:0], gate[:0], residual[:0]).shape == (0, N)


def test_bad_inputs_raise():
    with torch.device(DEVICE):  # every tensor made here on the tested device
        K, N, head_dim = 64, 16, 32
        x, weight, residual = torch.randn(2, 1, K), torch.randn(N, K), torch.randn(2, 1, N)
        norm_weight, head_weight = torch.ones(K), torch.ones(head_dim)
        cases = [
            ("x must be a tensor", lambda: gemv.rms_norm_linear(torch.randn(2, K + 1), norm_weight, EPS, weight)),
            ("x must be float32", lambda: gemv.linear_residual(x.long(), weight, residual)),
            ("weight must be a tensor", lambda: gemv.rms_norm_linear(x, norm_weight, EPS, weight[0])),
            ("weight must be contiguous", lambda: gemv.linear_residual(x, torch.randn(K, N).T, residual)),
            ("weight must be of x's dtype", lambda: gemv.rms_norm_linear(x, norm_weight, EPS, weight.double())),
            ("norm_weight must be", lambda: gemv.rms_norm_linear(x, torch.ones(K + 1), EPS, weight)),
            ("norm_weight must be", lambda: gemv.rms_norm_linear(x, torch.ones(K, dtype=torch.int32), EPS, weight)),
            ("up_weight must be", lambda: gemv.rms_norm_swiglu(x, norm_weight, EPS, weight, weight[:-1])),
            ("gate must be", lambda: gemv.gated_rms_norm_linear(x, x[:1], head_weight, EPS, head_dim, weight,
                                                                residual)),
            ("head_dim must be", lambda: gemv.gated_rms_norm_linear(x, x, head_weight, EPS, 48, weight, residual)),
            ("norm_weight must be", lambda: gemv.gated_rms_norm_linear(x, x, norm_weight, EPS, head_dim, weight,
                                                                       residual)),
            ("residual must be", lambda: gemv.linear_residual(x, weight, residual[:, :, :-1])),
            ("residual must be", lambda: gemv.gated_rms_norm_linear(x, x, head_weight, EPS, head_dim, weight,
                                                                    residual.half())),
            ("split_counters must be a contiguous 1-d int32",
             lambda: gemv.linear_residual(x, weight, residual, split_counters=torch.zeros(8))),
            ("no backward", lambda: gemv.linear_residual(x, weight.requires_grad_(), residual)),
        ]
        for message, call in cases:
            with pytest.raises(ValueError, match=message):
                call()
        with torch.no_grad():  # without grad mode the same call runs
            gemv.linear_residual(x, weight, residual)


def test_too_few_split_counters_raise(monkeypatch):
    monkeypatch.setattr(gemv, "SPLIT_K_MAX_ROWS", 16)
    with torch.device(DEVICE), torch.no_grad():
        x, weight, residual = torch.randn(4, 256), torch.randn(100, 256), torch.randn(4, 100)
        with pytest.raises(ValueError, match="split_counters holds 3 counters, this product's 4 tiles need one each"):
            gemv.linear_residual(x, weight, residual, split_counters=torch.zeros(3, dtype=torch.int32))


# The 400M model's step (hidden 1024, 8 heads of 128, SwiGLU 2816): the in-projection's q, k, v,
# a, b, gamma (8 heads each) and g rows from the attention norm; o_proj with the gated head norm
# and the residual; gate and up from the MLP norm; down with the residual.
REAL_SIZES = [("rms_norm_linear", 1024, 2 * 1024 + 1024 + 3 * 8 + 1024, None),
              ("gated_rms_norm_linear", 1024, 1024, 128),
              ("rms_norm_swiglu", 1024, 2816, None),
              ("linear_residual", 2816, 1024, None)]


# (rows, tiles): the launch's tiles with K whole or split (the one-row path, or from 4 rows the
# tl.dot path), and row tiles (4 rows and 2 outputs a program, chunks of 1024) for 4 and 16 rows.
REAL_SIZE_TILES = [(rows, tiles) for rows in (1, 4, 16) for tiles in ("whole K", "split K", "row tiles")
                   if rows > 1 or tiles != "row tiles"]


@pytest.mark.parametrize("rows,tiles", REAL_SIZE_TILES, ids=[f"{rows}-{tiles}" for rows, tiles in REAL_SIZE_TILES])
@pytest.mark.parametrize("name,K,N,head_dim", REAL_SIZES, ids=[case[0] for case in REAL_SIZES])
@on_gpu
def test_bf16_at_real_sizes(reslin, monkeypatch, name, K, N, head_dim, rows, tiles):
    """bf16 compiled at the 400M shapes, a decode step's [B, 1, K]: within bf16 rounding of the
    fp32 reference (1e-2) and no further from it than the unfused bf16 path (+ 1e-3), and near
    that path: within one bf16 rounding (4e-3) where the two round in the same places, two (8e-3)
    after the row norm at one row and in row tiles, whose broadcast product rounds x times the
    norm's weight and applies 1/rms to the fp32 sum where the unfused path rounds the normed row
    (SwiGLU's two products: over 4e-3 on an H100, 4.9-5.3e-3 in torch on the CPU with both
    roundings). With K split (at 4 and 16 rows, on the tl.dot path), the same bits at every call:
    the splits' sums are added in one order whichever program ends last."""
    split = tiles == "split K"
    monkeypatch.setattr(gemv, "SPLIT_K_MAX_ROWS", 16 if split else 0)
    monkeypatch.setattr(gemv, "SPLIT_K_MAX_TILES", 2**20)  # every product split, not only the default's
    if tiles == "row tiles":
        monkeypatch.setattr(gemv, "gemv_launch", lambda *_: (4, 2, 1024, 4, 1, False, 1))
    inputs = make_inputs(name, (rows, 1), K, N, head_dim, dtype=torch.bfloat16)
    with torch.no_grad():
        y = fused(name, inputs, head_dim)
        expected = unfused(reslin, name, inputs, head_dim, fused_layers=True)
        if split:
            assert all(torch.equal(fused(name, inputs, head_dim), y) for _ in range(20))
    assert y.shape == expected.shape and y.dtype == torch.bfloat16 and torch.isfinite(y).all()
    reference = fp32_reference(name, [t.float() for t in inputs], head_dim)
    assert rel_err(y, reference) <= min(1e-2, rel_err(expected, reference) + 1e-3)
    two_roundings = (rows == 1 or tiles == "row tiles") and name in ("rms_norm_linear", "rms_norm_swiglu")
    assert rel_err(y, expected) <= (8e-3 if two_roundings else 4e-3)


def test_benchmark_smoke_run_prints_every_row_and_the_sweep(capsys, monkeypatch):
    """benchmarks/bench_gemv.py --smoke: a row per entry point and batch, ours against the unfused
    path within fp32's rounding (bf16's on a GPU); --sweep ranks the tiles it tried, the launch's
    pick among them; --pdl and --split time ours again, each module's own setting back after."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import bench_gemv

    bench_gemv.main(["--smoke", "--rows", "1", "2", "--entry-points", "gated_rms_norm_linear", "rms_norm_swiglu"])
    rows = re.findall(r"^(\w+) +smoke +(\d+) +([\d.]+) .* ([\d.e+-]+)  \(", capsys.readouterr().out, re.M)
    assert [(name, int(batch)) for name, batch, *_ in rows] == [
        ("gated_rms_norm_linear", 1), ("gated_rms_norm_linear", 2), ("rms_norm_swiglu", 1), ("rms_norm_swiglu", 2)]
    assert all(float(us) > 0 and float(error) <= (1e-5 if DEVICE == "cpu" else 4e-3) for *_, us, error in rows)
    bench_gemv.main(["--smoke", "--rows", "2", "--entry-points", "linear_residual", "--sweep"])
    assert "<- gemv_launch's pick, " in capsys.readouterr().out
    default = bench_gemv.triton_launch.PROGRAMMATIC_LAUNCH_MAX_ROWS
    bench_gemv.main(["--smoke", "--rows", "1", "--entry-points", "linear_residual", "--pdl"])
    out = capsys.readouterr().out
    assert " PDL us " in out and float(re.search(r"([\d.]+)  \(1, ", out)[1]) > 0  # ours again, under PDL
    assert bench_gemv.triton_launch.PROGRAMMATIC_LAUNCH_MAX_ROWS == default  # its own setting back
    monkeypatch.setattr(bench_gemv.gemv, "DOT_BLOCK_K", 16)  # chunks of 16: the smoke shape's K of 48 in three
    monkeypatch.setattr(bench_gemv.gemv, "SPLIT_K_MAX_ROWS", 0)  # the pick unsplit, the split column beside it
    default = bench_gemv.gemv.SPLIT_K_MAX_ROWS
    bench_gemv.main(["--smoke", "--rows", "2", "--entry-points", "linear_residual", "--split"])
    out = capsys.readouterr().out
    assert " split us " in out and float(re.search(r"([\d.]+)  \(16, ", out)[1]) > 0
    assert "(16, 32, 16, 4, 4, False, 1), split (16, 32, 16, 4, 4, False, 2)" in out
    assert bench_gemv.gemv.SPLIT_K_MAX_ROWS == default
