"""A generation step's greedy token choice in two launches, for generate's own loop
(generation_reslin._Steps): where the torch code takes ten to twenty small kernels a step (the
cast to fp32, the minimum lengths' masks, the argmax, the end-of-sequence bookkeeping, the
writes), each a launch in the step's chain of dependent kernels.

    greedy_choice(logits, masked_ids, masked_until, eos_ids, pad_id, unfinished, sequences,
                  any_unfinished, token, position)

chooses as `_Steps.choose` does without sampling, bit for bit: the first column of the largest
score (a NaN counts as the largest, as torch.argmax counts it), a minimum length's end-of-sequence
ids scored -inf before their length, ended rows given the padding id. The scores are the logits in
their own dtype: their cast to fp32 is exact, so the order and the ties are the same.
"""

import torch

try:
    from .kernels_reslin_triton_launch import (_cdiv, _Launcher, _next_power_of_2, _on_inputs_device,
                                               _wait_for_previous_kernel, programmatic_launch, tl, triton)
except ImportError:
    from kernels_reslin_triton_launch import (_cdiv, _Launcher, _next_power_of_2, _on_inputs_device,
                                              _wait_for_previous_kernel, programmatic_launch, tl, triton)

# Columns a program scans: the 32000 of a 400M model's vocabulary in 16 programs a row, each one
# round of loads.
PART_COLUMNS = 2048
MAX_ROWS = 1024  # the bookkeeping's one program holds every row


@triton.jit
def _first_largest(values, indices, axis: tl.constexpr):
    """(the largest of values along axis, its first index in `indices`), a NaN the largest."""
    is_nan = values != values
    big = tl.full(indices.shape, 2**62, dtype=tl.int64)
    first_nan = tl.min(tl.where(is_nan, indices, big), axis=axis)
    numbers = tl.where(is_nan, float("-inf"), values)
    largest = tl.max(numbers, axis=axis)
    if axis == 0:
        at_largest = numbers == largest
    else:
        at_largest = numbers == largest[:, None]
    first = tl.min(tl.where(at_largest, indices, big), axis=axis)
    has_nan = first_nan < 2**62
    return tl.where(has_nan, float("nan"), largest), tl.where(has_nan, first_nan, first)


@_Launcher
@triton.jit
def _part_argmax_kernel(logits_ptr, row_stride, V, masked_ids_ptr, masked_until_ptr, position_ptr,
                        part_value_ptr, part_index_ptr, PARTS,
                        N_MASKED: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program (b, p): the first largest score of row b in columns p * BLOCK onwards."""
    _wait_for_previous_kernel(PDL)
    b, p = tl.program_id(0).to(tl.int64), tl.program_id(1)
    cols = p * BLOCK + tl.arange(0, BLOCK)
    scores = tl.load(logits_ptr + b * row_stride + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    position = tl.load(position_ptr)
    for i in tl.static_range(N_MASKED):
        masked = (cols == tl.load(masked_ids_ptr + i)) & (position < tl.load(masked_until_ptr + i))
        scores = tl.where(masked, float("-inf"), scores)
    value, index = _first_largest(scores, cols.to(tl.int64), 0)
    tl.store(part_value_ptr + b * PARTS + p, value)
    tl.store(part_index_ptr + b * PARTS + p, index)


@_Launcher
@triton.jit
def _bookkeeping_kernel(part_value_ptr, part_index_ptr, PARTS, B, eos_ids_ptr, pad_id_ptr, unfinished_ptr,
                        sequences_ptr, sequences_stride, any_unfinished_ptr, token_ptr, position_ptr,
                        N_EOS: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_P: tl.constexpr, PDL: tl.constexpr):
    """One program: each row's token from its parts, then what `_Steps.choose` writes."""
    _wait_for_previous_kernel(PDL)
    rows = tl.arange(0, BLOCK_B)
    parts = tl.arange(0, BLOCK_P)
    row_ok = rows < B
    ok = row_ok[:, None] & (parts < PARTS)[None, :]
    offsets = rows[:, None] * PARTS + parts[None, :]
    values = tl.load(part_value_ptr + offsets, mask=ok, other=float("-inf"))
    part_indices = tl.load(part_index_ptr + offsets, mask=ok, other=0)
    # Parts in column order: the first largest part holds the row's first largest column.
    _, part = _first_largest(values, tl.broadcast_to(parts[None, :], [BLOCK_B, BLOCK_P]).to(tl.int64), 1)
    token = tl.sum(tl.where(parts[None, :] == part[:, None], part_indices, 0), axis=1)
    unfinished = tl.load(unfinished_ptr + rows, mask=row_ok, other=0) != 0
    if N_EOS > 0:
        token = tl.where(unfinished, token, tl.load(pad_id_ptr))
        is_eos = token != token
        for i in tl.static_range(N_EOS):
            is_eos = is_eos | (token == tl.load(eos_ids_ptr + i))
        unfinished = unfinished & ~is_eos
        tl.store(unfinished_ptr + rows, unfinished.to(tl.int1), mask=row_ok)
    any_unfinished = tl.max((unfinished & row_ok).to(tl.int32), axis=0) != 0
    position = tl.load(position_ptr)
    tl.store(sequences_ptr + rows.to(tl.int64) * sequences_stride + position, token, mask=row_ok)
    tl.store(any_unfinished_ptr + position, any_unfinished.to(tl.int1))
    tl.store(token_ptr + rows, tl.where(any_unfinished, token, 0), mask=row_ok)
    tl.store(position_ptr, position + 1)


@_on_inputs_device
def greedy_choice(logits, masked_ids, masked_until, eos_ids, pad_id, unfinished, sequences, any_unfinished, token,
                  position):
    """The next token of every row, chosen and written as `_Steps.choose` does without sampling.

    logits [B, V] (unit column stride, any float dtype); masked_ids, masked_until [n] int64: column
    masked_ids[i] scored -inf while position < masked_until[i] (the minimum lengths); eos_ids [m]
    int64 or None (then no row ends and pad_id is not read); pad_id [] or [1] int64. Updated in
    place: unfinished [B] bool, sequences [B, L] int64 (column `position` written),
    any_unfinished [L] bool, token [B, 1] int64 (the next step's input: the token, 0 once every
    row has ended), position [1] int64 (moved on by one). No host sync."""
    B, V = logits.shape
    if B > MAX_ROWS:
        raise ValueError(f"greedy_choice takes at most {MAX_ROWS} rows, got {B}")
    if logits.stride(1) != 1:
        raise ValueError("greedy_choice needs logits with unit column stride")
    parts = _cdiv(V, PART_COLUMNS)
    part_values = torch.empty(B, parts, device=logits.device, dtype=torch.float32)
    part_indices = torch.empty(B, parts, device=logits.device, dtype=torch.int64)
    n_masked = masked_ids.numel()
    _part_argmax_kernel[(B, parts)](logits, logits.stride(0), V, masked_ids if n_masked else position,
                                    masked_until if n_masked else position, position, part_values, part_indices,
                                    parts, N_MASKED=n_masked, BLOCK=PART_COLUMNS, **programmatic_launch(logits))
    n_eos = 0 if eos_ids is None else eos_ids.numel()
    _bookkeeping_kernel[(1,)](part_values, part_indices, parts, B, eos_ids if n_eos else position,
                              pad_id if n_eos else position, unfinished, sequences, sequences.stride(0),
                              any_unfinished, token, position, N_EOS=n_eos, BLOCK_B=_next_power_of_2(B),
                              BLOCK_P=_next_power_of_2(parts), **programmatic_launch(logits))
