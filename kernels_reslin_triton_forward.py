"""The chunked forward of every rule (DESIGN.md, "Chunked form") as a chain of kernel launches:

    T^-1 (and P)       `_chunk_gram_kernel`             every chunk at once   (delta rule; RLA's P)
    W, U0              `_chunk_wy_kernel`               every chunk at once   (delta rule)
    S's states h       `_chunk_state_kernel`            chunk after chunk     (or a scan, or segments)
    R's writes         `_chunk_residual_writes_kernel`  every chunk at once   (residual rules)
    R's states h_R     `_chunk_state_kernel`            chunk after chunk
    o                  `_chunk_output_kernel`           every chunk at once

`chunk_forward` runs it; `_ChunkRun` holds one call's inputs laid out as packed tokens, the
path its shape takes (kernels_reslin_triton_tuning) and the buffers the steps pass along. The
backward builds the same run again (recomputing is cheaper than keeping h).

Precision: states, decays and the inverse's blocks in fp32; the large dots take their operands in
the input dtype (fp32 accumulation), exact fp32 ("ieee") for fp32 inputs. T^-1, P, W, U0, U and h
are stored in the input dtype; final states stay fp32.
"""

import functools

import torch

try:
    from .kernels_reslin_torch import sequence_bounds
    from .kernels_reslin_triton_common import TRITON_DTYPES
    from .kernels_reslin_triton_launch import _cdiv, _next_power_of_2, _on_inputs_device, tl
    from .kernels_reslin_triton_output import _chunk_output_kernel
    from .kernels_reslin_triton_state import (_chunk_decay_kernel, _chunk_local_state_kernel, _chunk_pass_factors_kernel,
                                              _chunk_residual_writes_kernel, _chunk_segment_starts_kernel,
                                              _chunk_state_join_kernel, _chunk_state_kernel, _chunk_state_scan_kernel)
    from .kernels_reslin_triton_tuning import (GRAM_WARPS, OUTPUT_ROWS, SCAN_BLOCK, SCAN_CHUNKS, SCAN_WARPS,
                                               forward_chunk_size, fuse_residual_passes, kept_segments,
                                               output_launched_dependent, output_tile, pass_scans_decays,
                                               pipeline_stages, register_cap, scans_states, state_pass_stages,
                                               state_segments, state_tile, writes_from_inverse, writes_launch,
                                               wy_programs)
    from .kernels_reslin_triton_wy import _chunk_gram_kernel, _chunk_wy_kernel
except ImportError:
    from kernels_reslin_torch import sequence_bounds
    from kernels_reslin_triton_common import TRITON_DTYPES
    from kernels_reslin_triton_launch import _cdiv, _next_power_of_2, _on_inputs_device, tl
    from kernels_reslin_triton_output import _chunk_output_kernel
    from kernels_reslin_triton_state import (_chunk_decay_kernel, _chunk_local_state_kernel, _chunk_pass_factors_kernel,
                                             _chunk_residual_writes_kernel, _chunk_segment_starts_kernel,
                                             _chunk_state_join_kernel, _chunk_state_kernel, _chunk_state_scan_kernel)
    from kernels_reslin_triton_tuning import (GRAM_WARPS, OUTPUT_ROWS, SCAN_BLOCK, SCAN_CHUNKS, SCAN_WARPS,
                                              forward_chunk_size, fuse_residual_passes, kept_segments,
                                              output_launched_dependent, output_tile, pass_scans_decays,
                                              pipeline_stages, register_cap, scans_states, state_pass_stages,
                                              state_segments, state_tile, writes_from_inverse, writes_launch,
                                              wy_programs)
    from kernels_reslin_triton_wy import _chunk_gram_kernel, _chunk_wy_kernel


class _ChunkLayout:
    """Where the chunks of B rows of T tokens, or of packed sequences (cu_seqlens), lie."""

    def __init__(self, B, T, cu_seqlens, device, chunk_size):
        self.T, self.NT, self.varlen = T, _cdiv(T, chunk_size), cu_seqlens is not None
        if self.varlen:
            self.cu_seqlens = cu_seqlens.to(device=device, dtype=torch.int64)
            chunks = (self.cu_seqlens.diff() + chunk_size - 1) // chunk_size
            self.chunk_offsets = torch.nn.functional.pad(torch.cumsum(chunks, 0), (1, 0))
            self.num_sequences = len(chunks)
            # The grid needs it on the host: from the bounds the checks already read.
            bounds = sequence_bounds(cu_seqlens)
            self.num_chunks = sum(_cdiv(end - start, chunk_size) for start, end in zip(bounds[:-1], bounds[1:]))
            self.chunk_seq = torch.repeat_interleave(torch.arange(self.num_sequences, device=device), chunks,
                                                     output_size=self.num_chunks)
        else:  # computed inside the kernels; the table arguments are never read
            self.num_sequences, self.num_chunks = B, B * self.NT
            self.cu_seqlens = self.chunk_offsets = self.chunk_seq = torch.empty(1, device=device, dtype=torch.int64)


def _fresh_state(like):
    """An unwritten fp32 state shaped as `like`, for a pass that reads its initial state from
    `like` and writes its final one here: no copy of the initial state first."""
    return torch.empty_like(like, memory_format=torch.contiguous_format)


class _ChunkRun:
    """One chunked call: its inputs laid out as packed tokens, the path its shape takes, and
    everything the forward computes before its outputs: T^-1, the WY terms, the chunk-start states
    h and the writes U (of S, and of R with the residual state). Building it launches nothing;
    `forward_states` runs the chain.

    The backward builds it again (`for_backward`) and reads it, but for the delta rule's
    inverses, T^-1 (and T_R^-1 with the residual state): a training forward keeps them, as FLA
    keeps its A, one [1 or 2, tokens, heads, chunk] tensor in the input dtype, and the backward,
    given it (`inverse`), skips the gram kernel. A training forward of the delta rule over few long
    rows also keeps the fp32 states at its segments' starts (`kept_segments`), from which the
    backward's passes run every segment at once (`kept_states`)."""

    def __init__(self, q, k, v, g, beta, gamma, gamma_write, update, clip, cu_seqlens, chunk_size,
                 for_backward=False, training=False, inverse=None, kept_states=None):
        if inverse is not None and update != "delta":
            raise ValueError("kept inverses serve the delta rule only")
        B, T, H, Dk = q.shape
        HV, Dv = v.shape[2:]
        L = B * T
        layout = self.layout = _ChunkLayout(B, T, cu_seqlens, q.device, chunk_size)
        flat = lambda x: None if x is None else x.reshape(L, *x.shape[2:]).contiguous()  # noqa: E731
        self.q, self.k, self.v, self.g, self.beta, self.gamma, self.gamma_write = map(
            flat, (q, k, v, g, beta, gamma, gamma_write))
        self.residual, self.delta, self.clip, self.chunk_size = gamma is not None, update == "delta", clip, chunk_size
        residual, delta = self.residual, self.delta
        self.for_backward = for_backward
        if not residual:
            self.gamma_write = self.beta
        self.tables = (layout.cu_seqlens, layout.chunk_seq, layout.chunk_offsets)
        self.shape = dict(T=layout.T, NT=layout.NT, HV=HV, GROUP=HV // H, DK=Dk, DV=Dv)
        self.BK, self.BV_full = max(16, _next_power_of_2(Dk)), max(16, _next_power_of_2(Dv))
        self.DT = TRITON_DTYPES[q.dtype]
        self.warps = 4 if self.BK <= 128 else 8
        self.stages, self.backward_stages = pipeline_stages(q.dtype == torch.float32, self.BK)

        # The path: (sequence, value head) pairs set how many programs a sequential pass runs.
        self.sequence_heads = layout.num_sequences * HV
        self.from_inverse = writes_from_inverse(delta, residual, for_backward, self.BK, self.sequence_heads)
        self.scans = scans_states(delta, self.sequence_heads)
        self.pass_segments = state_segments(delta, layout.varlen, Dv, self.BV_full, self.sequence_heads, layout.NT)
        self.fused = residual and fuse_residual_passes(delta, self.sequence_heads, self.pass_segments)
        self.output_dependent = output_launched_dependent(q.is_cuda, residual, self.scans)
        self.segment_chunks, self.segments = kept_segments(update, layout.varlen, layout.num_sequences, HV, layout.NT)
        self.store_z = for_backward and residual  # z = v - pred, for the backward (`_clipped_residual`)
        self.inverse_given = inverse is not None

        # The buffers. Unused pointers point at a real tensor; the kernels never read them.
        v = self.v
        empty = lambda *shape: torch.empty(*shape, device=q.device, dtype=q.dtype)  # noqa: E731
        self.h = empty(layout.num_chunks, HV, Dk, Dv)
        self.h_residual, self.U_residual = ((empty(layout.num_chunks, HV, Dk, Dv), empty(L, HV, Dv))
                                            if residual else (self.h, v))
        self.z = empty(L, HV, Dv) if self.store_z else v
        self.X = self.X_residual = self.P = self.W = self.W_residual = self.U0 = self.U = v
        self.row_factors = self.chunk_factors = v
        if training and self.segment_chunks:
            kept_states = torch.empty(1 + residual, layout.num_sequences * self.segments, HV, Dk, Dv, device=q.device,
                                      dtype=torch.float32)
        self.kept_states = kept_states  # the forward's to keep, or the backward's to run from
        self.G = None  # the cumulative log decays: `cumulative_decays`
        self.inverses = None
        if delta:
            # Kept inverses leave the forward as an op's output: zeros where the kernels never write
            # them (the blocks above the diagonal), not whatever the memory held.
            fresh_inverse = torch.zeros if training else torch.empty
            self.inverses = inverse if inverse is not None else fresh_inverse(
                1 + residual, L, HV, chunk_size, device=q.device, dtype=q.dtype)
            self.X = self.inverses[0]
            if residual:
                self.X_residual = self.inverses[1]
            self.U = empty(L, HV, Dv)
            if not self.from_inverse:  # the WY kernel's
                self.U0, self.W = empty(L, HV, Dv), empty(L, HV, Dk)
                self.G = torch.empty(L, HV, device=q.device, dtype=torch.float32)
                if residual:
                    self.W_residual = empty(L, HV, Dk)
        # The writes kernel forms P itself, stored only for the backward; RLA's fused pass reads P
        # from the gram kernel.
        if residual and (self.fused or self.store_z):
            self.P = empty(L, HV, chunk_size)

    def forward_states(self, S0, R0):
        """The chain up to the output: T^-1 (and P), the WY terms, then the state passes, which
        store every chunk-start state. Sets the final states S and R (R is S without the residual
        state; None where the backward runs from kept states)."""
        if (self.delta or self.fused) and not self.inverse_given:
            self.invert_chunks()
        if self.delta and not self.from_inverse:
            self.wy_terms()
        if self.fused:
            self.S, self.R = self.advance_both(S0, R0)
            return
        if self.residual and self.scans:
            # RLA with every pass over all chunks at once: R's additions come with its writes.
            chunk_decay = self.chunk_additions(self.v, self.beta, self.h)
            self.S = self.scan(S0, self.h, chunk_decay)
            self.residual_writes(adds_to_state=True)
            self.R = self.scan(R0, self.h_residual, chunk_decay)
            return
        kept = (None, None) if self.kept_states is None else self.kept_states
        self.S = self.advance(S0, self.v, self.beta, self.X if self.from_inverse else self.W, self.U0, self.U, self.h,
                              kept[0])
        if not self.residual:
            self.R = self.S
            return
        writes = self.residual_writes(adds_to_state=False)
        W_residual = self.X_residual if self.from_inverse else self.W_residual
        self.R = self.advance(R0, writes, self.gamma_write, W_residual, writes, self.U_residual, self.h_residual,
                              kept[1])

    def common_constexprs(self):
        return dict(BC=self.chunk_size, BK=self.BK, DT=self.DT, VARLEN=self.layout.varlen)

    def invert_chunks(self):
        """`_chunk_gram_kernel`: T^-1 for S (and T_R^-1 for R) of the delta rule, P for RLA's fused
        pass, every chunk at once."""
        layout, HV = self.layout, self.shape["HV"]
        _chunk_gram_kernel[(layout.num_chunks, HV)](
            self.k, self.g, self.beta, self.gamma_write, *self.tables, self.X, self.X_residual, self.P, layout.T,
            layout.NT, HV, self.shape["GROUP"], self.shape["DK"], BLOCK=self.chunk_size // 4, DELTA=self.delta,
            RESIDUAL=self.residual, STORE_P=self.fused, **self.common_constexprs(), num_warps=GRAM_WARPS)

    def wy_terms(self):
        """`_chunk_wy_kernel`: U0 and W (and W_R) of the delta rule, and the cumulative decays G."""
        layout = self.layout
        _chunk_wy_kernel[(wy_programs(layout.num_chunks * self.shape["HV"], self.residual, self.q.device),)](
            self.k, self.v, self.g, self.beta, self.gamma_write, self.X, self.X_residual, *self.tables, self.W, self.U0,
            self.W_residual, self.G, **self.shape, NUM_CHUNKS=layout.num_chunks, BV=self.BV_full,
            RESIDUAL=self.residual, **self.common_constexprs(),
            num_warps=self.warps, num_stages=min(self.stages, 2))  # the next chunk's loads in flight

    def cumulative_decays(self, scan):
        """The pointer a sequential pass reads G from (`_chunk_decay`): the delta rule's WY kernel
        stores G; for the additive rule `_chunk_decay_kernel` forms it at the first pass that loads
        it (its scans and RLA's fused pass never do). A pass that scans g itself (the residual
        rules' S reverse pass) gets g."""
        if scan:
            return self.g
        if self.G is None:
            layout, HV = self.layout, self.shape["HV"]
            self.G = torch.empty_like(self.g, dtype=torch.float32)
            _chunk_decay_kernel[(layout.num_chunks,)](self.g, self.G, *self.tables, layout.T, layout.NT, HV,
                                                      BC=self.chunk_size, BH=_next_power_of_2(HV), VARLEN=layout.varlen)
        return self.G

    def residual_writes(self, adds_to_state):
        """`_chunk_residual_writes_kernel`: R's writes (and z) from S's chunk-start states h, every
        chunk at once, in the input dtype. Returns what R's pass writes with (None with
        `adds_to_state`, which stores what each chunk adds to R in h_residual instead)."""
        writes = None if adds_to_state else torch.empty_like(self.v)
        BV, warps = writes_launch(self.chunk_size, self.BV_full, self.warps)
        _chunk_residual_writes_kernel[(_cdiv(self.shape["DV"], BV), self.layout.num_chunks, self.shape["HV"])](
            self.k, self.v, self.g, self.beta, self.gamma_write, self.U, self.h, self.P, self.X_residual, self.z,
            self.v if adds_to_state else writes, self.U_residual, self.h_residual, *self.tables, self.clip,
            **self.shape, BC=self.chunk_size, BK=self.BK, BV=BV, DT=self.DT, DELTA=self.delta,
            WRITES_FROM_INVERSE=self.from_inverse, ADDS_TO_STATE=adds_to_state, STORE_Z=self.store_z,
            VARLEN=self.layout.varlen, num_warps=warps,
            num_stages=self.stages, maxnreg=self.register_cap(_chunk_residual_writes_kernel))
        return writes

    def advance_both(self, S0, R0):
        """RLA's S and R passes in one from S0 and R0. Returns the final S and R."""
        layout, HV = self.layout, self.shape["HV"]
        factors = functools.partial(torch.empty, device=S0.device, dtype=torch.float32)
        self.row_factors, self.chunk_factors = factors(self.g.shape[0], HV, 4), factors(layout.num_chunks, HV)
        _chunk_pass_factors_kernel[(layout.num_chunks,)](
            self.g, self.beta, self.gamma_write, self.row_factors, self.chunk_factors, *self.tables, layout.T,
            layout.NT, HV, BC=self.chunk_size, BH=_next_power_of_2(HV), VARLEN=layout.varlen)
        S, R = (_fresh_state(x) for x in (S0, R0))
        self.state_pass(S0.contiguous(), S, layout.cu_seqlens, layout.chunk_offsets, layout.num_sequences,
                        layout.varlen, self.v, self.beta, self.W, self.v, self.U, self.h,
                        residual_states=(R0.contiguous(), R), store_z=self.store_z)
        return S, R

    def advance(self, initial, v, strength, W, U0, U, h, kept=None):
        """One state's pass (`_chunk_state_kernel`) from `initial` over the writes (v and the write
        strength for the additive rule, U0 and W for the delta rule), storing h and, for the delta
        rule, U. `kept`: the state at its segments' starts (`kept_segments`), which a training
        forward's pass stores and the backward's recompute runs from. Returns the final state
        (None from kept starts: the backward never reads it)."""
        layout = self.layout
        if self.scans:
            return self.scan(initial, h, self.chunk_additions(v, strength, h))
        if kept is not None and self.for_backward:
            cu_seqlens, chunk_offsets, varlen, shape = self.kept_segment_rows()
            sequences = layout.num_sequences * self.segments
            self.state_pass(kept, torch.empty_like(kept), cu_seqlens, chunk_offsets, sequences, varlen, v, strength,
                            W, U0, U, h, sequence_heads=sequences * self.shape["HV"], shape=shape)
            return None
        if self.pass_segments > 1:
            return self.advance_in_segments(initial, self.pass_segments, v, strength, W, U0, U, h)
        final = _fresh_state(initial)
        self.state_pass(initial.contiguous(), final, layout.cu_seqlens, layout.chunk_offsets, layout.num_sequences,
                        layout.varlen, v, strength, W, U0, U, h, kept=kept)
        return final

    def state_pass(self, initial, final, cu_seqlens, chunk_offsets, sequences, varlen, v, strength, W, U0, U, h,
                   residual_states=None, store_z=False, kept=None, sequence_heads=None, shape=None):
        """`_chunk_state_kernel` over `sequences` rows of cu_seqlens, from the states `initial` into
        `final` (one tensor for both advances it in place); with `residual_states` (R's initial and
        final states), RLA's R advanced with S in the same pass (h_R, R's writes and, with store_z,
        z stored); with `kept`, the states at the kept segments' starts stored there. Its tiles are
        those of `sequence_heads` pairs (the call's, unless given); `shape`: the rows' T and NT in
        place of the call's (`kept_segment_rows`)."""
        both = residual_states is not None
        scan = not both and pass_scans_decays(self.from_inverse, self.delta, self.G is not None, self.sequence_heads)
        G = self.g if both else self.cumulative_decays(scan=scan)  # RLA's fused pass reads its factors
        tile = state_tile(self.BV_full, self.sequence_heads if sequence_heads is None else sequence_heads)
        _chunk_state_kernel[(_cdiv(self.shape["DV"], tile), sequences * self.shape["HV"])](
            self.k, v, G, strength, W, U0, U, h, initial, final,
            self.P, self.row_factors, self.chunk_factors, self.z, self.U_residual, self.h_residual,
            *(residual_states if both else (initial, final)), initial if kept is None else kept, cu_seqlens,
            chunk_offsets, self.clip, **(shape or self.shape), KEPT_SEGMENTS=1 if kept is None else self.segments,
            BC=self.chunk_size, BK=self.BK, BV=tile, DT=self.DT, DELTA=self.delta,
            WRITES_FROM_INVERSE=self.from_inverse, BOTH_STATES=both, STORE_Z=store_z, SCAN_G=scan,
            LAUNCHES_DEPENDENTS=self.output_dependent,
            KEPT_SEGMENT_CHUNKS=0 if kept is None else self.segment_chunks, VARLEN=varlen, num_warps=self.warps,
            num_stages=state_pass_stages(self.stages, tile))

    def register_cap(self, kernel):
        """`register_cap` for this call's rule, head size and dtype."""
        return register_cap(kernel.__name__, self.delta, self.residual, self.BK, self.DT == tl.float32)

    def chunk_additions(self, v, strength, h):
        """What every chunk of an additive state adds by its end from the writes diag(strength) v
        (`_chunk_local_state_kernel`, into h), all at once. Returns the chunks' log decays."""
        layout, HV, Dv = self.layout, self.shape["HV"], self.shape["DV"]
        BV = min(self.BV_full, 64)
        chunk_decay = torch.empty(layout.num_chunks, HV, device=h.device, dtype=torch.float32)
        _chunk_local_state_kernel[(_cdiv(Dv, BV), layout.num_chunks, HV)](
            self.k, v, self.g, strength, h, chunk_decay, *self.tables, **self.shape, BC=self.chunk_size, BK=self.BK,
            BV=BV, DT=self.DT, VARLEN=layout.varlen, num_warps=self.warps)
        return chunk_decay

    def scan(self, initial, h, chunk_decay):
        """An additive state's pass from `initial` by scan (`_chunk_state_scan_kernel`): h holds
        what every chunk adds on entry, the chunk-start states on exit. Returns the final state."""
        layout, HV, Dk, Dv = self.layout, self.shape["HV"], self.shape["DK"], self.shape["DV"]
        final = _fresh_state(initial)
        _chunk_state_scan_kernel[(_cdiv(Dk * Dv, SCAN_BLOCK), layout.num_sequences * HV)](
            chunk_decay, h, initial.contiguous(), final, layout.cu_seqlens, layout.chunk_offsets, layout.T,
            layout.NT, HV, Dk, Dv, BC=self.chunk_size, CHUNKS=SCAN_CHUNKS, BLOCK=SCAN_BLOCK, DT=self.DT,
            VARLEN=layout.varlen, num_warps=SCAN_WARPS)
        return final

    def advance_in_segments(self, initial, segments, v, strength, W, U0, U, h):
        """The state pass over every segment at once from zero states, then the join kernel: a
        segment's chunk-start states gain its start state (its row's initial state carried
        through the segments before it), decayed to each chunk; the final states come last."""
        layout, HV, BC = self.layout, self.shape["HV"], self.chunk_size
        B, T, NT = layout.num_sequences, layout.T, layout.NT
        segment_chunks = _cdiv(NT, segments)
        segments = _cdiv(NT, segment_chunks)  # none left empty
        cu_seqlens, chunk_offsets = self.segment_tables(segment_chunks, segments)
        padded = torch.nn.functional.pad(self.g.view(B, T, HV), (0, 0, 0, segments * segment_chunks * BC - T))
        # Log decays in fp32 whatever g's dtype (the kernels exponentiate them): each chunk's, each
        # segment's, and from a segment's start to each of its chunks' starts.
        chunk_decay = padded.view(B, segments, segment_chunks, BC, HV).sum(3, dtype=torch.float32)
        segment_decay = chunk_decay.sum(2)
        to_chunk = (chunk_decay.cumsum(2) - chunk_decay).view(B, segments * segment_chunks, HV)[:, :NT].contiguous()
        ends = torch.zeros(B * segments, *initial.shape[1:], device=initial.device, dtype=torch.float32)
        self.state_pass(ends, ends, cu_seqlens, chunk_offsets, B * segments, True, v, strength, W, U0, U, h)
        starts, final = torch.empty_like(ends), _fresh_state(initial)
        Dk, Dv = self.shape["DK"], self.shape["DV"]
        tile = state_tile(self.BV_full, self.sequence_heads)
        _chunk_segment_starts_kernel[(_cdiv(Dv, tile), B, HV)](
            initial.contiguous(), ends, segment_decay, starts, final, segments, HV, Dk, Dv, BK=self.BK,
            BV=tile, num_warps=self.warps)
        join_tile = min(self.BV_full, 64)
        _chunk_state_join_kernel[(_cdiv(Dv, join_tile), layout.num_chunks, HV)](
            h, starts, to_chunk, NT, segment_chunks, segments, HV, Dk, Dv, BK=self.BK, BV=join_tile, DT=self.DT,
            num_warps=self.warps)
        return final

    def kept_segment_rows(self):
        """(cu_seqlens, chunk_offsets, varlen, shape) of the backward's recompute over rows x
        segments from the kept starts: where the segments tile the rows exactly, rows of their
        own of segment_chunks chunks each (no tables to build), else packed sequences
        (`segment_tables`)."""
        layout = self.layout
        length = self.segment_chunks * self.chunk_size
        if layout.T == self.segments * length:
            return layout.cu_seqlens, layout.chunk_offsets, False, dict(self.shape, T=length, NT=self.segment_chunks)
        return (*self.segment_tables(self.segment_chunks, self.segments), True, self.shape)

    def segment_tables(self, segment_chunks, segments):
        """cu_seqlens and chunk_offsets of the B rows of T tokens cut into `segments` of
        `segment_chunks` chunks each (the last may be shorter), for a pass over them as sequences
        of their own."""
        layout = self.layout
        B, T, NT = layout.num_sequences, layout.T, layout.NT
        arange = functools.partial(torch.arange, device=self.g.device, dtype=torch.int64)
        rows, parts = arange(B)[:, None], arange(segments)[None, :]
        starts = (rows * T + parts * segment_chunks * self.chunk_size).flatten()  # a multiple of BC: the chunks stay
        return torch.cat([starts, starts.new_full((1,), B * T)]), (rows * NT + parts * segment_chunks).flatten()

    def output(self, scale):
        """`_chunk_output_kernel`: o [tokens, HV, Dv] in v's dtype."""
        o = torch.empty_like(self.v)
        HV, Dv = self.v.shape[1:]
        BV = output_tile(self.BK, self.BV_full)
        rows = min(self.chunk_size, OUTPUT_ROWS)
        dependent = self.output_dependent
        _chunk_output_kernel[(_cdiv(Dv, BV), self.layout.num_chunks * (self.chunk_size // rows), HV)](
            self.q, self.k, self.v, self.g, self.beta, self.U, self.h, self.gamma if self.residual else self.g,
            self.U_residual, self.h_residual, o, *self.tables, scale, **self.shape, BC=self.chunk_size, BR=rows,
            BK=self.BK, BV=BV, DT=self.DT, DELTA=self.delta, RESIDUAL=self.residual, DEPENDENT=dependent,
            VARLEN=self.layout.varlen, num_warps=self.warps, num_stages=self.stages, launch_pdl=dependent)
        return o


@_on_inputs_device
def chunk_forward(q, k, v, g, beta, gamma, gamma_write, update, clip, scale, S0, R0, cu_seqlens,
                  chunk_size=None, training=False):
    """Forward of every rule over [B, T] or packed (cu_seqlens) sequences, the same contract as
    kernels_reslin_torch.chunk_reslin: returns (o in v's dtype, S, R) with fp32 states. With
    `training` two values more, what chunk_backward reads if given: the inverses (`inverse`, [1 or
    2, tokens, HV, chunk]: T^-1 and T_R^-1; None but for the delta rule) and the kept states
    (`kept_states`, [1 or 2 states, rows x segments, HV, Dk, Dv] fp32; None but where
    `kept_segments` keeps some).
    chunk_size None: `forward_chunk_size`'s (a differentiable call passes the backward's,
    CHUNK_SIZE)."""
    if chunk_size is None:
        sequences = q.shape[0] if cu_seqlens is None else len(cu_seqlens) - 1
        chunk_size = forward_chunk_size(update, gamma is not None, sequences, v.shape[2])
    run = _ChunkRun(q, k, v, g, beta, gamma, gamma_write, update, clip, cu_seqlens, chunk_size, training=training)
    run.forward_states(S0, R0)
    outputs = run.output(scale).reshape(v.shape), run.S, (run.R if run.residual else None)
    return (*outputs, run.inverses, run.kept_states) if training else outputs
