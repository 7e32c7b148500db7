"""The @triton.jit building blocks of ResLin's chunked kernels: tile loads and stores of the
packed token layout ([tokens, heads, width]), where a sequence and a chunk begin and end, and dots
at the precision each operand needs.

Layout (DESIGN.md): the tokens of every sequence lie one after another; chunks of BC tokens never
straddle two sequences, and the rows of a short tail chunk load as zeros (g = 0, strength b = 0,
k = 0), which neither decay nor write any state.
"""

import torch

try:
    from .kernels_reslin_triton_launch import tl, triton
except ImportError:
    from kernels_reslin_triton_launch import tl, triton

TRITON_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _mm(a, b, DT: tl.constexpr, acc=None):
    """a @ b, fp32 accumulation, operands cast to DT (exact fp32 dots when DT is fp32); added into
    the fp32 `acc` where given (one accumulator for a sum of products: fewer registers held)."""
    if DT == tl.float32:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        out = tl.dot(a.to(DT), b.to(DT), acc)
    return out


@triton.jit
def _load_rows(ptr, rows, row_ok, head, heads, cols, width):
    """x[rows, head, cols] of a [tokens, heads, width] tensor, zero outside it."""
    offsets = (rows * heads + head)[:, None] * width + cols[None, :]
    return tl.load(ptr + offsets, mask=row_ok[:, None] & (cols < width)[None, :], other=0.0)


@triton.jit
def _load_columns(ptr, rows, row_ok, head, heads, cols, width):
    """x[rows, head, cols] transposed, [cols, rows]: loaded so, it is a dot's left operand as it
    lies in shared memory; transposing a loaded tile in registers slows the sequential loops."""
    offsets = (rows * heads + head)[None, :] * width + cols[:, None]
    return tl.load(ptr + offsets, mask=row_ok[None, :] & (cols < width)[:, None], other=0.0)


@triton.jit
def _store_rows(ptr, rows, row_ok, head, heads, cols, width, x):
    offsets = (rows * heads + head)[:, None] * width + cols[None, :]
    tl.store(ptr + offsets, x.to(ptr.dtype.element_ty), mask=row_ok[:, None] & (cols < width)[None, :])


@triton.jit
def _sequence_bounds(seq, cu_seqlens_ptr, chunk_offsets_ptr, T, NT, VARLEN: tl.constexpr):
    """First token, end and first chunk of a sequence."""
    if VARLEN:
        bos, eos = tl.load(cu_seqlens_ptr + seq), tl.load(cu_seqlens_ptr + seq + 1)
        first_chunk = tl.load(chunk_offsets_ptr + seq)
    else:
        bos = seq.to(tl.int64) * T
        eos = bos + T
        first_chunk = (seq * NT).to(tl.int64)
    return bos, eos, first_chunk


@triton.jit
def _chunk_bounds(chunk, cu_seqlens_ptr, chunk_seq_ptr, chunk_offsets_ptr, T, NT,
                  BC: tl.constexpr, VARLEN: tl.constexpr):
    """A chunk's first token and the end of its sequence (int64 token indices)."""
    seq = tl.load(chunk_seq_ptr + chunk) if VARLEN else chunk // NT  # else B rows of T tokens, NT chunks each
    bos, eos, first_chunk = _sequence_bounds(seq, cu_seqlens_ptr, chunk_offsets_ptr, T, NT, VARLEN)
    return bos + (chunk - first_chunk).to(tl.int64) * BC, eos


@triton.jit
def _token_scalars(ptr, rows, row_ok, head, HV):
    return tl.load(ptr + rows * HV + head, mask=row_ok, other=0.0).to(tl.float32)


@triton.jit
def _mm_fp32(a, b, DT: tl.constexpr):
    """a @ b of fp32 operands: exact for fp32 inputs, tf32 tensor cores when the inputs are
    bf16/fp16 (whose own rounding is 8x coarser)."""
    if DT == tl.float32:
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b, input_precision="tf32")
    return out


@triton.jit
def _lower_decay(G, BC: tl.constexpr):
    """e^(G_i - G_j) for j <= i, 0 above the diagonal (masked before the exponential, which
    would overflow there)."""
    r = tl.arange(0, BC)
    return tl.exp(tl.where(r[:, None] >= r[None, :], G[:, None] - G[None, :], float("-inf")))


@triton.jit
def _load_lower(ptr, rows, row_ok, head, HV, BC: tl.constexpr):
    """A chunk's [BC, BC] matrix written by `_store_lower`, zeros above the diagonal."""
    r = tl.arange(0, BC)
    return tl.where(r[:, None] >= r[None, :], _load_rows(ptr, rows, row_ok, head, HV, r, BC), 0.0)


@triton.jit
def _state_tile(seq_head, kcols, vcols, DK, DV):
    """Offsets and mask of a [BK, BV] tile of state number seq_head."""
    offsets = seq_head.to(tl.int64) * DK * DV + kcols[:, None] * DV + vcols[None, :]
    ok = (kcols < DK)[:, None] & (vcols < DV)[None, :]
    return offsets, ok

