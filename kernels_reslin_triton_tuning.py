"""How the chunked Triton kernels launch: chunk lengths, value tiles, warps, pipelining depths,
register caps, and which path a call takes (segments, scans, fused passes, programmatic
dependent launches), each a function of the call's rule, head size, dtype and number of
(sequence, value head) pairs. Everything here was chosen by timing on an H200 (bf16, D128); the
ideas tried and what they gave are in benchmarks/README.md's tuning table.

`launch_variants` lists every kernel variant these choices launch, for tools/compile_for_gpu.py,
which compiles each for sm_90 and checks its shared memory without a GPU.
"""

import functools

import torch

try:
    from .kernels_reslin_triton_launch import _cdiv
except ImportError:
    from kernels_reslin_triton_launch import _cdiv

CHUNK_SIZE = 64
# A forward whose backward will not run may take longer chunks (`forward_chunk_size`). The output
# kernel still reads OUTPUT_ROWS rows a program.
LONG_CHUNK_SIZE = 128
OUTPUT_ROWS = 64
# One warp per chunk for T^-1 and P: its 16 x 16 blocks leave more warps idle.
GRAM_WARPS = 1

# The additive rule's state recurrence over few long sequences is split into segments
# (`state_segments`) until about PARALLEL_PROGRAMS programs run it (~8 per SM of an H200), in
# segments of at least MIN_SEGMENT_CHUNKS chunks, when that makes at least MIN_SEGMENTS.
PARALLEL_PROGRAMS = 1024
MIN_SEGMENT_CHUNKS = 16
MIN_SEGMENTS = 16
# The delta rule's state passes over fewer than KEPT_BELOW_SEQUENCE_HEADS (row, head) pairs: a
# training forward keeps the state at the start of every segment of each row, as many segments
# as bring the (segment, head) pairs to KEPT_SEQUENCE_HEADS, each at least MIN_KEPT_SEGMENT_CHUNKS
# long, so that the backward's recompute runs every segment at once (`kept_segments`).
KEPT_BELOW_SEQUENCE_HEADS = 64
KEPT_SEQUENCE_HEADS = 128
MIN_KEPT_SEGMENT_CHUNKS = 16
# `_chunk_state_scan_kernel`: state elements a program, chunks folded at a time (at least 16, a
# dot's rows; 8 does not compile for sm_90), and warps.
SCAN_BLOCK = 128
SCAN_CHUNKS = 16
SCAN_WARPS = 2
# num_warps of `_chunk_grad_values_kernel`.
GRAD_VALUES_WARPS = 4


def pipeline_stages(fp32, BK):
    """Software-pipelining depth (num_stages) of the sequential state kernel and the output
    kernel, and of the reverse state kernel, within an H200's 227 KB of shared memory (sizes from
    tools/compile_for_gpu.py). Pipelined fp32 tiles take twice the memory of bf16 ones."""
    if fp32:
        return 1, 1
    if BK > 128:  # the state kernel's K^T, W and S tiles need 263 KB at 3 stages
        return 2, 1
    return 3, 3


def state_pass_stages(stages, value_tile):
    """num_stages of `_chunk_state_kernel`: one more than the other kernels' (`pipeline_stages`)
    over value tiles of 16 and 32, whose shared memory leaves room for it."""
    return stages + (value_tile <= 32 and stages == 3)  # 3: 16-bit inputs, D <= 128


def reverse_warps(value_tile, warps):
    """num_warps of `_chunk_state_backward_kernel`: 8 over value tiles of 64 (every rule from 128
    sequence-heads, `state_tile`)."""
    return 8 if value_tile >= 64 else warps


def grad_keys_launches(delta, residual, BV_full, fp32):
    """(key tile, launches) of `_chunk_grad_keys_kernel`: the columns of K a program takes, and
    (side, num_warps, num_stages, value tile) of each launch. The residual rules, with twice the
    accumulators, run it as two or three sides on 4 warps each, so that two programs fit a SM
    where the whole kernel on 8 warps fits one; RDN's keys' side is split by state. In fp32 the
    delta rule's key tiles of 128 would need 320 KB of shared memory: 64."""
    if not residual:
        return (64 if fp32 else 128, [(0, 8, 3, min(BV_full, 64))]) if delta else (64, [(0, 4, 3, min(BV_full, 32))])
    if delta:
        return 64, [(1, 4, 3, min(BV_full, 32)), (3, 4, 3, min(BV_full, 32)), (4, 4, 3, min(BV_full, 64))]
    return 64, [(1, 4, 3, min(BV_full, 32)), (2, 4, 3, min(BV_full, 32))]


def output_tile(BK, BV_full):
    """Value columns a program of `_chunk_output_kernel` owns: whole value rows up to 128, so that
    Q K^T is formed once a chunk. D256 keeps tiles of 64 (untimed at 128, which needs 213 KB of
    shared memory with the residual state)."""
    return min(BV_full, 128 if BK <= 128 else 64)


def local_grad_tile(delta, residual, BV_full):
    """Value columns a program of `_chunk_local_grad_kernel` takes; each forms its chunk's Q K^T:
    whole rows of 128 but for sGLA's kernel, which is faster over tiles of 64."""
    return min(BV_full, 128 if delta or residual else 64)


def grad_values_sides(delta, residual):
    """The SIDEs of `_chunk_grad_values_kernel`'s launches: RDN's two inverses in one program
    spill registers, so R's side and then S's run as launches of their own."""
    return (1, 2) if delta and residual else (0,)


def wy_programs(items, residual, device):
    """Programs of `_chunk_wy_kernel`, each looping over (chunk, head) items: for the residual
    delta rule two a SM, so that an item's loads are in flight while the one before computes; one
    program an item for gdn, which loses that way."""
    return min(items, 2 * _multiprocessors(device)) if residual else items


@functools.lru_cache
def _multiprocessors(device):
    """SMs of a CUDA device. In Triton's interpreter any count serves; a small one makes the
    persistent kernels' programs loop over several items there too, as they do on a GPU."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2


def writes_launch(chunk_size, BV_full, warps):
    """Value tile and warps of `_chunk_residual_writes_kernel`: tiles of 64, but whole value rows
    up to 128 on 8 warps in chunks of LONG_CHUNK_SIZE (RLA's forward over few sequence-heads),
    whose P and K K^T are then formed once a chunk."""
    if chunk_size > CHUNK_SIZE and BV_full <= 128:
        return BV_full, 8
    return min(BV_full, 64), warps


# ptxas's register cap (`maxnreg`) by kernel name and (delta, residual), where a cap lets one more
# 4-warp program onto a SM (<= 128 registers: four, <= 168: three) and was timed to pay, spills and
# all. A cap moves ptxas's allocation even below it, so none goes where it was not timed.
_REGISTER_CAPS = {
    "_chunk_residual_writes_kernel": lambda delta, residual: 128 if delta else None,
    "_chunk_grad_values_kernel": lambda delta, residual: 168 if delta or residual else None,
    "_chunk_local_grad_kernel": lambda delta, residual: 168 if delta and residual else None,
    "_chunk_residual_grad_kernel": lambda delta, residual: 128 if delta else None,
}


def register_cap(kernel_name, delta, residual, BK, fp32):
    """The register cap that the kernel named `kernel_name` launches with, None for none
    (`_REGISTER_CAPS`). Only at key tiles of 128 in bf16 / fp16, the sizes timed: fp32 and wider
    heads hold more, smaller ones less."""
    if BK != 128 or fp32 or kernel_name not in _REGISTER_CAPS:
        return None
    return _REGISTER_CAPS[kernel_name](delta, residual)


def kept_segments(update, varlen, sequences, HV, NT):
    """(chunks a segment, segments a row) whose start states a training forward keeps for the
    backward's recompute, (0, 1) for none: the delta rule over rows of equal length, fewer than
    KEPT_BELOW_SEQUENCE_HEADS (row, head) pairs. Its passes run one program a value tile and pair,
    chunk after chunk; from the kept starts the recompute runs every segment at once, as many
    programs as KEPT_SEQUENCE_HEADS pairs would. The states cost a few [HV, DK, DV] fp32 tensors a
    row; from 64 pairs storing them slows the forward's pass more than the recompute gains."""
    segments = min(KEPT_SEQUENCE_HEADS // (sequences * HV), NT // MIN_KEPT_SEGMENT_CHUNKS)
    if update != "delta" or varlen or sequences * HV >= KEPT_BELOW_SEQUENCE_HEADS or segments < 2:
        return 0, 1
    segment_chunks = _cdiv(NT, segments)
    return segment_chunks, _cdiv(NT, segment_chunks)  # none left empty


def forward_chunk_size(update, residual, sequences, HV):
    """The chunk length of a forward whose backward will not run: LONG_CHUNK_SIZE for sGLA below
    64 sequence-heads and RLA below 32, else CHUNK_SIZE. There the additive rule's state passes
    run on few programs, or (by scan) store every chunk's state twice: longer chunks halve both
    the states stored and the loop's steps. The delta rule's T^-1 costs 4x in chunks of 128."""
    long_chunks = update == "additive" and sequences * HV < (32 if residual else 64)
    return LONG_CHUNK_SIZE if long_chunks else CHUNK_SIZE


def state_tile(BV_full, sequence_heads, reverse=False):
    """Value columns a program of the sequential kernels owns (forward, or `reverse`): few
    sequence-heads leave SMs idle, so narrower tiles then: 16 below 32 sequence-heads, 32 up to
    64 (the reverse kernel: 128), else 64."""
    if sequence_heads < 32:
        return min(BV_full, 16)
    wide = sequence_heads >= (128 if reverse else 64)
    return min(BV_full, 64 if wide else 32)


def writes_from_inverse(delta, residual, for_backward, BK, sequence_heads):
    """Whether the forward's delta-rule state passes form their writes U = T^-1 diag(b) (V -
    diag(e^G) K h) from T^-1, the values and the keys they load anyway, in place of reading
    U0 = T^-1 diag(b) V and W = T^-1 diag(b e^G) K: no WY kernel runs then (the passes scan g for
    G), and RDN's writes kernel stores R's clipped residuals r for R's pass. It costs one more
    dot on the loop's chain than W h, which pays from 64 sequence-heads (from 32 with one state).
    Not for the backward's recompute, which reads W, nor at D256, where the loop spills."""
    return delta and not for_backward and BK <= 128 and sequence_heads >= (64 if residual else 32)


def pass_scans_decays(from_inverse, delta, decays_stored, sequence_heads):
    """Whether a state pass scans g itself every chunk instead of loading the stored cumulative
    decays G: the delta rule's passes that form their writes from T^-1 (no WY kernel stores G for
    them), and the additive rule's from 128 sequence-heads, where the pass runs programs enough to
    hide the scan, while no G is stored (the forward's decay kernel is then not launched)."""
    return from_inverse or (not delta and not decays_stored and sequence_heads >= 128)


def scans_states(delta, sequence_heads):
    """Whether the additive rule's state passes run as every chunk's own writes at once, then a
    scan over the chunks, instead of `_chunk_state_kernel`, whose sequential loop forms a product
    every chunk: below 32 sequence-heads, where that loop runs on few programs for many chunks.
    RLA's too, R's additions made with its writes and P formed there, with no gram kernel."""
    return not delta and sequence_heads < 32


def state_segments(delta, varlen, DV, BV_full, sequence_heads, NT):
    """Segments each sequence's state recurrence is split into (1: not split). Few long
    sequences leave most SMs idle along the sequential loop; the additive rule's states can run in
    segments side by side, since S's writes K^T diag(b) V do not depend on S, nor R's on R. The
    delta rule's writes U = U0 - W h do. The join passes over h once more: it pays from 16
    segments."""
    if delta or varlen:
        return 1
    programs = _cdiv(DV, state_tile(BV_full, sequence_heads)) * sequence_heads
    segments = min(PARALLEL_PROGRAMS // programs, NT // MIN_SEGMENT_CHUNKS)
    return segments if segments >= MIN_SEGMENTS else 1


def fuse_residual_passes(delta, sequence_heads, segments):
    """Whether RLA's two state passes run as one (`_chunk_state_kernel` with BOTH_STATES): where
    the state tiles are narrow, from 32 to 63 sequence-heads, each pass then runs few programs and
    the writes kernel between them is a third launch over every chunk. Below 32 RLA's passes are
    scans (`scans_states`); where they run in segments, those stay."""
    return not delta and 32 <= sequence_heads < 64 and segments == 1


def output_launched_dependent(on_cuda, residual, scans):
    """Whether the output kernel is launched as a programmatic dependent of the state pass before
    it (PDL), forming Q K^T while that pass ends: the residual rules' on CUDA, but not after RLA's
    scans, which leave no pass to overlap. sGLA and gdn gain nothing from it."""
    return on_cuda and residual and not scans


def queries_side_launched_dependent(on_cuda, residual):
    """Whether the residual rules' keys' gradients' queries side (SIDE 1) is launched as a
    programmatic dependent of S's reverse pass (PDL): on CUDA. It reads only what the recomputed
    forward stored, so all of it but its stores may run while that pass ends."""
    return on_cuda and residual


def launch_variants(BK, BV_full, delta, residual, fp32):
    """Every kernel variant that a call of this rule, head size and dtype can launch, for large
    batches and the few-sequence paths alike: [(kernel name, constexprs beyond DT / DELTA /
    RESIDUAL / VARLEN, num_warps, num_stages)], each chosen by the functions above."""
    warps = 4 if BK <= 128 else 8
    wide_tile = min(BV_full, 64)
    stages, backward_stages = pipeline_stages(fp32, BK)
    long_writes_tile, long_writes_warps = writes_launch(LONG_CHUNK_SIZE, BV_full, warps)
    key_tile, keys_launches = grad_keys_launches(delta, residual, BV_full, fp32)
    kept_chunks = (0, 32) if delta else (0,)  # KEPT_SEGMENT_CHUNKS: any nonzero value compiles alike
    additive_only = not delta

    def state_pass(tile, stages, BC=CHUNK_SIZE, from_inverse=False, both=False, store_z=False, scan_g=False,
                   dependents=False, kept=0):
        return ("_chunk_state_kernel", dict(BC=BC, BK=BK, BV=tile, WRITES_FROM_INVERSE=from_inverse,
                                            BOTH_STATES=both, STORE_Z=store_z, SCAN_G=scan_g,
                                            LAUNCHES_DEPENDENTS=dependents, KEPT_SEGMENT_CHUNKS=kept), warps, stages)

    variants = []
    if delta or residual:  # sGLA needs neither T^-1 nor P
        variants.append(("_chunk_gram_kernel", dict(BC=CHUNK_SIZE, BLOCK=CHUNK_SIZE // 4, BK=BK,
                                                    STORE_P=residual and not delta), GRAM_WARPS, 3))
    if delta:  # U0 and W for the passes that read them
        variants.append(("_chunk_wy_kernel", dict(BC=CHUNK_SIZE, BK=BK, BV=BV_full), warps, min(stages, 2)))
    # The state pass over wide tiles: reading U0 and W, or forming the writes from T^-1 (scanning g);
    # the additive rule's from 128 sequence-heads scans g itself. The delta rule's training forward
    # below 128 sequence-heads keeps its segments' starts.
    wide_paths = (((False, False), (True, True)) if delta and BK <= 128 else
                  ((False, False),) if delta else ((False, False), (False, True)))
    variants += [state_pass(wide_tile, stages, from_inverse=from_inverse, scan_g=scan_g, dependents=residual,
                            kept=kept) for from_inverse, scan_g in wide_paths for kept in kept_chunks]
    # Narrower tiles below 64 sequence-heads.
    variants += [state_pass(min(BV_full, tile), state_pass_stages(stages, tile), dependents=residual, kept=kept)
                 for tile in ((16, 32) if delta else (32,)) for kept in kept_chunks]
    # The delta rule's pass with one state forms its writes from T^-1 from 32 sequence-heads on.
    if delta and not residual and BK <= 128:
        variants += [state_pass(min(BV_full, 32), state_pass_stages(stages, 32), from_inverse=True, scan_g=True,
                                kept=kept) for kept in kept_chunks]
    if residual:
        # R's writes: the forward's, the backward's recompute (storing z), and RLA's below 32
        # sequence-heads adding R's writes to R for its scan (ADDS_TO_STATE).
        variants += [("_chunk_residual_writes_kernel",
                      dict(BC=CHUNK_SIZE, BK=BK, BV=wide_tile, ADDS_TO_STATE=adds, STORE_Z=store_z,
                           WRITES_FROM_INVERSE=from_inverse), warps, stages)
                     for adds in ((False,) if delta else (False, True)) for store_z in (False, True)
                     for from_inverse in ((False, True) if delta and not (adds or store_z) else (False,))]
        if additive_only:  # RLA's two passes in one (below 64 sequence-heads), forward and recompute
            variants += [state_pass(min(BV_full, 32), state_pass_stages(stages, 32), both=True, store_z=store_z)
                         for store_z in (False, True)]
    if additive_only:
        variants += [
            ("_chunk_decay_kernel", dict(BC=CHUNK_SIZE, BH=16), 4, 1),
            # Below 32 sequence-heads: every chunk's writes, then the scan; or segments and their join.
            ("_chunk_local_state_kernel", dict(BC=CHUNK_SIZE, BK=BK, BV=wide_tile), warps, 3),
            ("_chunk_state_scan_kernel", dict(BC=CHUNK_SIZE, CHUNKS=SCAN_CHUNKS, BLOCK=SCAN_BLOCK), SCAN_WARPS, 3),
            ("_chunk_segment_starts_kernel", dict(BK=BK, BV=wide_tile), warps, 3),
            ("_chunk_state_join_kernel", dict(BK=BK, BV=wide_tile), warps, 3),
        ]
        if residual:
            variants.append(("_chunk_pass_factors_kernel", dict(BC=CHUNK_SIZE, BH=16), 4, 1))
    # The output kernel; in chunks of LONG_CHUNK_SIZE for a forward without gradients; the residual
    # rules' launched dependent on R's pass (PDL).
    output_chunks = ((CHUNK_SIZE, False), *(((LONG_CHUNK_SIZE, False),) if additive_only else ()),
                     *(((CHUNK_SIZE, True),) if residual else ()))
    variants += [("_chunk_output_kernel", dict(BC=chunk, BR=OUTPUT_ROWS, BK=BK, BV=output_tile(BK, BV_full),
                                               DEPENDENT=dependent), warps, stages) for chunk, dependent in output_chunks]
    if additive_only:  # the additive rule's passes in chunks of LONG_CHUNK_SIZE
        if not residual:
            variants.append(state_pass(min(BV_full, 32), state_pass_stages(stages, 32), BC=LONG_CHUNK_SIZE))
        variants += [
            ("_chunk_local_state_kernel", dict(BC=LONG_CHUNK_SIZE, BK=BK, BV=wide_tile), warps, 3),
            ("_chunk_state_scan_kernel", dict(BC=LONG_CHUNK_SIZE, CHUNKS=SCAN_CHUNKS, BLOCK=SCAN_BLOCK), SCAN_WARPS, 3),
        ]
        if residual:
            variants.append(("_chunk_residual_writes_kernel",
                             dict(BC=LONG_CHUNK_SIZE, BK=BK, BV=long_writes_tile, ADDS_TO_STATE=True, STORE_Z=False,
                                  WRITES_FROM_INVERSE=False), long_writes_warps, stages))
    # The backward.
    variants.append(("_chunk_local_grad_kernel", dict(BC=CHUNK_SIZE, BK=BK, BV=local_grad_tile(delta, residual, BV_full),
                                                       STATE_PART=not delta), warps, 3))
    # The reverse passes: S's alone, or R's (gamma dO) then S's (with pred's dz); S's of the residual
    # rules then launches the keys' gradients' queries side as its dependent (PDL).
    reverse_tile = state_tile(BV_full, 128, reverse=True)
    variants += [("_chunk_state_backward_kernel", dict(BC=CHUNK_SIZE, BK=BK, BV=reverse_tile, GATED_READ=gated,
                                                       PRED=pred, WHOLE_DU=delta, FINAL_GRAD=True,
                                                       LAUNCHES_DEPENDENTS=pred),
                  reverse_warps(reverse_tile, warps), backward_stages)
                 for gated, pred in (((True, False), (False, True)) if residual else ((False, False),))]
    if residual:
        variants.append(("_chunk_residual_grad_kernel", dict(BC=CHUNK_SIZE, BV=wide_tile), warps, 1))
    variants += [("_chunk_grad_keys_kernel", dict(BC=CHUNK_SIZE, BK=min(BK, key_tile), BV=value_tile, SIDE=side,
                                                  DEPENDENT=side == 1), keys_warps, keys_stages)
                 for side, keys_warps, keys_stages, value_tile in keys_launches]
    variants += [("_chunk_grad_values_kernel", dict(BC=CHUNK_SIZE, BK=BK, BV=wide_tile, KEY_TILES=max(1, BK // key_tile),
                                                    STATE_PART=residual and not delta, SIDE=side),
                  GRAD_VALUES_WARPS, 2) for side in grad_values_sides(delta, residual)]
    return variants
