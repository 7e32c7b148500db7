"""ResLin models: causal LMs whose token mixers are residual / Kaczmarz / gated-delta linear attention.

The recurrence itself (DESIGN.md section 1) lives in `reslin_attention` (kernels_reslin.py); this
file computes its inputs (features and gates), wraps it in pre-norm blocks with a SwiGLU MLP, and
handles padding masks and the generation cache. Parameter names follow FLA's GatedDeltaNet
(`layers.*.attn.{q,k,v}_proj`, `a_proj`, `b_proj`, `A_log`, `dt_bias`, `{q,k,v}_conv1d`,
`g_proj`, `o_norm`, `o_proj`, `mlp.{gate,up,down}_proj`, `model.norm`, `lm_head`), so FLA
checkpoints convert by copying names, but for the input embedding's: transformers' `embed_tokens`
(FLA's `embeddings`), the name PEFT looks for to tie and save embeddings. The residual rules add
`gamma_proj`.

Padding: a padded position leaves every state as it found it (its conv input is zeroed, and
g = beta = gamma = 0 there), and full attention layers mask padded keys and take RoPE positions
from the mask, so each row of a padded batch gives the logits of that row run alone.

Generation on CUDA: a recurrent block's step runs five fused kernels (ResLinBlock.fused_decode_step),
a step of a model whose layers are all recurrent is replayed from a CUDA graph, and `generate`
chooses tokens on the device (generation_reslin.py): a step's launches, not its bytes, are its cost.
"""

import copy
import functools
import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.generation.configuration_utils import GenerationMode
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from transformers.utils import logging

# Every module of the model is imported here, those unused by one name (F401): save_pretrained and
# the remote-code loader copy the files this file imports (`from .x import`), and loaders before
# transformers 5.10 follow no further. Imported plainly (a folder on sys.path), nothing ships.
try:
    from .cache_reslin import ResLinCache
    from .configuration_reslin import ResLinConfig
    from .constants_reslin import MAX_HEAD_DIM  # noqa: F401
    from .context_parallel_reslin import context_parallel_forward  # noqa: F401
    from .generation_reslin import (CACHE_FIELD, DeviceDecoding, ResLinDecodeGraph, graph_can_run,
                                    release_kept_step, runs_only_its_forward)
    from .inputs_reslin import (check_attention_mask, check_labels, check_logits_to_keep,
                                check_model_inputs, check_prompt, check_token_values)
    from .kernels_reslin import reslin_attention, reslin_decode_step
    from .kernels_reslin_torch import chunk_reslin, sequence_bounds  # noqa: F401
except ImportError:
    from cache_reslin import ResLinCache
    from configuration_reslin import ResLinConfig
    from generation_reslin import (CACHE_FIELD, DeviceDecoding, ResLinDecodeGraph, graph_can_run,
                                   release_kept_step, runs_only_its_forward)
    from inputs_reslin import (check_attention_mask, check_labels, check_logits_to_keep,
                               check_model_inputs, check_prompt, check_token_values)
    from kernels_reslin import reslin_attention, reslin_decode_step
    from kernels_reslin_torch import sequence_bounds
try:
    try:
        from .kernels_reslin_triton import chunk_attention  # noqa: F401
        from .kernels_reslin_triton_backward import chunk_backward  # noqa: F401
        from .kernels_reslin_triton_choice import greedy_choice  # noqa: F401
        from .kernels_reslin_triton_common import TRITON_DTYPES  # noqa: F401
        from .kernels_reslin_triton_decode import projected_decode_step
        from .kernels_reslin_triton_forward import chunk_forward  # noqa: F401
        from .kernels_reslin_triton_gemv import gated_rms_norm_linear, linear_residual, rms_norm_linear, rms_norm_swiglu
        from .kernels_reslin_triton_launch import _Launcher  # noqa: F401
        from .kernels_reslin_triton_layers import gates as fused_gates, rms_norm as fused_rms_norm
        from .kernels_reslin_triton_layers import short_convolution as fused_short_convolution, swiglu as fused_swiglu
        from .kernels_reslin_triton_output import _chunk_output_kernel  # noqa: F401
        from .kernels_reslin_triton_state import _chunk_state_kernel  # noqa: F401
        from .kernels_reslin_triton_tuning import CHUNK_SIZE  # noqa: F401
        from .kernels_reslin_triton_wy import _chunk_wy_kernel  # noqa: F401
    except ImportError:
        from kernels_reslin_triton_decode import projected_decode_step
        from kernels_reslin_triton_gemv import gated_rms_norm_linear, linear_residual, rms_norm_linear, rms_norm_swiglu
        from kernels_reslin_triton_layers import gates as fused_gates, rms_norm as fused_rms_norm
        from kernels_reslin_triton_layers import short_convolution as fused_short_convolution, swiglu as fused_swiglu
except ImportError:  # no Triton: the torch code below serves everywhere
    fused_rms_norm = fused_short_convolution = fused_swiglu = fused_gates = None

# ResLinBlock.fused_decode_step at up to this many rows (the GEMV kernels' range); False: the unfused step.
FUSED_DECODE_STEP, FUSED_DECODE_MAX_ROWS = True, 16

logger = logging.get_logger(__name__)


def uses_fused_layers(config):
    """Whether the layers may run the fused Triton kernels of kernels_reslin_triton_layers (the
    kernel backend "torch" keeps the whole model in torch code)."""
    return fused_rms_norm is not None and config.kernel_backend in ("auto", "triton")


def runs_fused(fused, x):
    """Whether a fused kernel replaces the torch code beside it: eagerly on CUDA, where that code
    is one kernel launch and one trip through memory per elementwise operation, with fp32
    intermediates kept for the backward. torch.compile fuses the torch code by itself."""
    return fused and x.is_cuda and not torch.compiler.is_compiling()


def l2_normalize(x, eps=1e-6):
    """x / sqrt(||x||^2 + eps) in fp32, written as rms_norm(x) with eps / D, divided by sqrt(D):
    two kernels on CUDA (F.rms_norm is fused there) where the formula written out is five."""
    D = x.shape[-1]
    return (F.rms_norm(x.float(), (D,), eps=eps / D) * D ** -0.5).to(x.dtype)


class ResLinRMSNorm(nn.Module):
    """RMSNorm in fp32. Called with `projections`, the nn.Linear layers that read its output, it
    returns their outputs instead: on the fused path, where each is a plain nn.Linear, one autograd
    node that keeps no copy of the normed x for their weights' gradients (each nn.Linear would keep
    one), as wide as x; the backward forms it again."""

    read_dims = 1  # the projections read the output's last `read_dims` dimensions flattened

    def __init__(self, hidden_size, eps=1e-6, fused=False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.fused = fused

    def forward(self, x, projections=()):
        return self.normed(x, None, projections)

    def extra_repr(self):
        return f"{self.weight.shape[0]}, eps={self.eps}"

    def normed(self, x, gate, projections):
        if runs_fused(self.fused, x):
            read_shape = x.shape[:x.dim() - self.read_dims]
            if projections and all(map(is_plain_linear, projections)):
                outputs = fused_rms_norm(x, self.weight, self.eps, gate, [p.weight for p in projections])
                return tuple(output.view(*read_shape, -1) for output in outputs)
            y = fused_rms_norm(x, self.weight, self.eps, gate=gate)
        else:
            # In fp32; F.rms_norm is one fused kernel on CUDA, where the formula written out is five.
            y = F.rms_norm(x.float(), self.weight.shape, self.weight.float(), self.eps)
            y = (y if gate is None else y * F.silu(gate.float())).to(x.dtype)
        if not projections:
            return y
        y = y.flatten(x.dim() - self.read_dims)
        return tuple(projection(y) for projection in projections)


class ResLinGatedRMSNorm(ResLinRMSNorm):
    """RMSNorm(o) * SiLU(gate) per head, in fp32 (FLA's FusedRMSNormGated); its projections read the
    heads side by side."""

    read_dims = 2

    def forward(self, x, gate, projections=()):
        return self.normed(x, gate, projections)


class ResLinShortConvolution(nn.Conv1d):
    """Causal depthwise convolution followed by SiLU; weight [D, 1, K] like FLA's ShortConvolution.

    `state` holds the last K - 1 inputs before `x` (zeros at the start of a sequence), so a
    prefill, a decode step and a prefill continuing from a cache read one window. With packed
    sequences, `positions` [B, T] (each token's index in its own sequence) keeps every window
    inside its sequence. With `l2_head_size` each head of that many channels is L2-normalised
    after the SiLU (q and k): the fused kernel then keeps no unnormalised copy for the backward.
    """

    def __init__(self, dim, kernel_size, fused=False):
        super().__init__(dim, dim, kernel_size, groups=dim, bias=False)
        self.fused = fused

    def forward(self, x, state=None, positions=None, l2_head_size=None, inference=False):
        """`inference`: autograd is off (the layer decides it once a call): the fused kernel then
        moves a cache's state along in place."""
        if runs_fused(self.fused, x):
            if state is not None and inference and state.dtype == x.dtype and state.is_contiguous():
                # A cache's state, moved along by the kernel itself: no window formed, no copy back.
                return fused_short_convolution(x, self.weight, state, positions, l2_head_size, update_state=True), state
            y = fused_short_convolution(x, self.weight, state, positions, l2_head_size)
            return y, self.last_inputs(x, state)
        x = x.transpose(1, 2)  # [B, D, T]
        if state is None:
            state = x.new_zeros(x.shape[0], x.shape[1], self.kernel_size[0] - 1)
        x = torch.cat([state.to(x.dtype), x], dim=-1)
        T, K = x.shape[-1] - state.shape[-1], self.kernel_size[0]
        # Taps in the input's dtype: under autocast fp32 taps would turn bf16 activations into fp32
        # ones, and the attention kernels would then take their slow exact fp32 path.
        weight = self.weight.to(x.dtype)
        if T == 1:
            # One token (a decode step): its window times the taps, summed. Two kernels where the
            # loop below launches 2K, and launches are what a decode step's time goes to. (A single
            # token's window never crosses a packed sequence's start: without a cache it is zeros.)
            y = (x * weight[:, 0]).sum(-1, keepdim=True)
        else:
            # The K taps as K shifted multiply-adds: on a CPU 2-5x faster than F.conv1d's depthwise
            # path at these shapes (measured at K=4, T up to 2048).
            y = 0
            for i in range(K):
                tap = x[..., i:i + T] * weight[:, 0, i, None]
                reach = K - 1 - i  # how far back this tap reads
                y = y + (tap if positions is None or reach == 0 else tap * (positions >= reach)[:, None].to(tap.dtype))
        y = F.silu(y).transpose(1, 2)
        if l2_head_size is not None:
            y = l2_normalize(y.unflatten(-1, (-1, l2_head_size))).flatten(-2)
        return y, x[..., T:]

    def last_inputs(self, x, state):
        """The state after x [B, T, D]: its last K - 1 inputs, [B, D, K - 1]."""
        window = self.kernel_size[0] - 1
        if x.shape[1] >= window:
            return x[:, x.shape[1] - window:].transpose(1, 2)
        if state is None:
            state = x.new_zeros(x.shape[0], x.shape[2], window)
        return torch.cat([state.to(x.dtype), x.transpose(1, 2)], dim=-1)[..., -window:]


class ResLinLinearAttention(nn.Module):
    """The recurrent token mixer: features and gates per head, then `reslin_attention`."""

    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_heads
        self.num_v_heads = config.num_v_heads
        self.head_dim = config.head_dim
        self.head_v_dim = config.head_v_dim
        self.update_rule = config.update_rule
        self.step_rule = config.step_rule
        self.use_residual = config.use_residual
        self.residual_clip = config.residual_clip
        self.kaczmarz_eps = config.kaczmarz_eps
        self.kernel_backend = config.kernel_backend
        key_dim = self.num_heads * self.head_dim
        value_dim = self.num_v_heads * self.head_v_dim

        self.q_proj = nn.Linear(config.hidden_size, key_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, key_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, value_dim, bias=False)
        self.a_proj = nn.Linear(config.hidden_size, self.num_v_heads, bias=False)
        self.b_proj = nn.Linear(config.hidden_size, self.num_v_heads, bias=config.write_gate_bias)
        if self.use_residual:
            self.gamma_proj = nn.Linear(config.hidden_size, self.num_v_heads, bias=config.write_gate_bias)
        # Filled by ResLinPreTrainedModel._init_weights (Mamba2's initialisation).
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads))
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads))
        self.mark_no_weight_decay()
        self.fused = uses_fused_layers(config)
        self.q_conv1d = ResLinShortConvolution(key_dim, config.conv_size, self.fused)
        self.k_conv1d = ResLinShortConvolution(key_dim, config.conv_size, self.fused)
        self.v_conv1d = ResLinShortConvolution(value_dim, config.conv_size, self.fused)
        self.g_proj = nn.Linear(config.hidden_size, value_dim, bias=False)
        self.o_norm = ResLinGatedRMSNorm(self.head_v_dim, eps=config.norm_eps, fused=self.fused)
        self.o_proj = nn.Linear(value_dim, config.hidden_size, bias=False)

    def mark_no_weight_decay(self):
        # Read by optimiser set-ups (as in FLA / Mamba): decaying the decay-rate parameters is wrong.
        self.A_log._no_weight_decay = True
        self.dt_bias._no_weight_decay = True

    def projections(self):
        """The input projections, in the order their outputs lie side by side in a generation step's
        one product: q, k, v, a, b, (c), the output gate."""
        projections = [self.q_proj, self.k_proj, self.v_proj, self.a_proj, self.b_proj]
        if self.use_residual:
            projections.append(self.gamma_proj)
        return projections + [self.g_proj]

    def fused_decode_step(self, x, norm, cache):
        """x + this layer's output at a generation step on CUDA, in three launches (the block's norm
        with the projections' one product over their weights side by side, kept by the cache, and
        the short convolutions of its q, k and v; the decode kernel, which forms the L2 norms, the
        gates and KLA's step; the gated output norm with the output projection and the residual
        add), where the unfused step launches about fourteen."""
        weight, made_now = cache.side_by_side_weight(self.layer_idx, [p.weight for p in self.projections()])
        convolutions = ((self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight),
                        cache.conv_states[self.layer_idx])
        counters = cache.split_counters(x.device)
        projected = rms_norm_linear(x, norm.weight, norm.eps, weight, weight_just_written=made_now,
                                    convolutions=convolutions, split_counters=counters)
        S, R = cache.recurrent_states[self.layer_idx]
        o = projected_decode_step(projected, self.A_log, self.dt_bias, S, R, num_heads=self.num_heads,
                                  head_dim=self.head_dim, num_v_heads=self.num_v_heads, head_v_dim=self.head_v_dim,
                                  update=self.update_rule, clip=self.residual_clip,
                                  kaczmarz=self.step_rule == "kaczmarz", kaczmarz_eps=self.kaczmarz_eps,
                                  states_just_written=False)
        gate = projected[..., projected.shape[-1] - self.g_proj.out_features:]
        return gated_rms_norm_linear(o.flatten(-2), gate, self.o_norm.weight, self.o_norm.eps, self.head_v_dim,
                                     self.o_proj.weight, x, split_counters=counters)

    def input_projections(self, x, norm=None, inference=False, cache=None):
        """q, k and v before their convolutions, the gates' a, b and c (c None without the residual
        state) and the output norm's gate, of x, or with `norm` of norm(x), which then gives the
        projections' outputs itself (keeping no normed copy of x for their weights' gradients). A
        generation step on CUDA (`inference`: autograd off) takes them from one GEMM over the
        weights side by side, which `cache` keeps: each projection alone is a launch on few SMs."""
        projections = self.projections()
        if x.shape[1] == 1 and inference and runs_fused(self.fused, x) and all(map(is_plain_linear, projections)):
            x = x if norm is None else norm(x)
            weights = [projection.weight for projection in projections]
            weight = torch.cat(weights) if cache is None else cache.side_by_side_weight(self.layer_idx, weights)[0]
            outputs = F.linear(x, weight).split([projection.out_features for projection in projections], dim=-1)
        elif norm is not None:
            outputs = norm(x, projections)
        else:
            outputs = [projection(x) for projection in projections]
        return tuple(outputs) if self.use_residual else (*outputs[:5], None, outputs[5])

    def gates(self, a, b, c, inference=False):
        """In fp32 from the gates' projections: g = -exp(A_log) * softplus(a + dt_bias) <= 0,
        beta = sigmoid(b), gamma = sigmoid(c) (None without the residual state). Without autograd on
        CUDA in one fused kernel (a generation step's time goes to its launches); `inference`:
        autograd is off."""
        if inference and runs_fused(self.fused, a):
            return fused_gates(a, b, c, self.A_log, self.dt_bias)
        # -logsigmoid(-x) is softplus(x) (to rounding): torch's softplus backward has fake strides
        # that differ from its eager ones, which breaks compiled backwards (aot_eager, torch 2.13).
        g = self.A_log.float().exp() * F.logsigmoid(-(a.float() + self.dt_bias.float()))
        return g, b.float().sigmoid(), None if c is None else c.float().sigmoid()

    def forward(self, x, attention_mask=None, position_ids=None, cache=None, cu_seqlens=None, norm=None):
        """`attention_mask`: None (no padding) or bool [B, past + T]. `cu_seqlens`: packed
        sequences in one row, whose `position_ids` then restart at 0 for each sequence. `norm`: the
        block's norm, applied to x here (`input_projections`), or None where x is normed already."""
        B, T, _ = x.shape
        # A decode step's token is real in every row: generate extends the mask with ones, and the
        # padding of earlier tokens is in the states already (transformers 5.24's own recurrent
        # layers skip it for one token too: masking_utils.create_recurrent_attention_mask).
        token_mask = None if attention_mask is None or is_decode_step(cache, T) else attention_mask[:, -T:]
        if token_mask is not None:
            # Zero inputs keep the short convolutions' windows as if padding were not there (a zero
            # row's norm is zero: masking before the norm is masking after it).
            x = x * token_mask[..., None].to(x.dtype)

        conv_state = cache.conv_states[self.layer_idx] if cache is not None else None
        q_state, k_state, v_state = conv_state if conv_state is not None else (None, None, None)
        positions = position_ids if cu_seqlens is not None else None
        # q and k come out of their convolutions L2-normalised per head; KLA keeps raw keys.
        kaczmarz = self.step_rule == "kaczmarz"
        # Decided once a call and passed down: without autograd a generation step advances the cache's
        # states in place, and the inference-only fused kernels apply.
        inference = not torch.is_grad_enabled()
        q, k, v, a, b, c, gate = self.input_projections(x, norm, inference, cache)
        q, q_state = self.q_conv1d(q, q_state, positions, self.head_dim, inference)
        k, k_state = self.k_conv1d(k, k_state, positions, None if kaczmarz else self.head_dim, inference)
        v, v_state = self.v_conv1d(v, v_state, positions, None, inference)
        q = q.view(B, T, self.num_heads, self.head_dim)
        k = k.view(B, T, self.num_heads, self.head_dim)
        v = v.view(B, T, self.num_v_heads, self.head_v_dim)

        g, beta, gamma = self.gates(a, b, c, inference)
        gamma_write = None  # the residual state's write strength, when it is not gamma itself
        if kaczmarz:
            # KLA keeps raw keys and takes the step eta / (||k||^2 + eps), per key head shared by its value
            # heads. With raw keys the residual state's delta rule needs the same step (a plain gamma
            # diverges once gamma ||k||^2 > 2), while its read keeps gamma.
            # (vector_norm in fp32 keeps no fp32 copy of k for the backward, where k.float() would.)
            # (Each elementwise op is a kernel of a generation step: the denominator formed once, spread
            # over value heads only where there are more of them.)
            denominator = torch.linalg.vector_norm(k, dim=-1, dtype=torch.float32).square() + self.kaczmarz_eps
            if self.num_v_heads != self.num_heads:
                denominator = denominator.repeat_interleave(self.num_v_heads // self.num_heads, dim=-1)
            beta = beta / denominator
            gamma_write = gamma / denominator if gamma is not None else None
        if token_mask is not None:
            # a = exp(0) = 1 and zero write strengths: a padded position passes every state through unchanged.
            step = token_mask.to(g.dtype)[..., None]
            g, beta, gamma, gamma_write = (t if t is None else t * step for t in (g, beta, gamma, gamma_write))

        state = cache.recurrent_states[self.layer_idx] if cache is not None else None
        if state is not None and T == 1 and inference:
            # A generation step: advance the cached fp32 states in place (the fused decode kernel on
            # CUDA). Not under autograd, where an earlier graph may still need the old states.
            o = reslin_decode_step(q, k, v, g, beta, state, gamma=gamma, gamma_write=gamma_write,
                                   update=self.update_rule, clip=self.residual_clip, backend=self.kernel_backend)
        else:
            o, state = reslin_attention(q, k, v, g, beta, gamma, update=self.update_rule, clip=self.residual_clip,
                                        initial_state=state, output_final_state=cache is not None,
                                        cu_seqlens=cu_seqlens, backend=self.kernel_backend,
                                        gamma_write=gamma_write)
        if cache is not None:
            cache.update_linear(self.layer_idx, (q_state, k_state, v_state), state)

        o, = self.o_norm(o, gate.view(B, T, self.num_v_heads, self.head_v_dim), (self.o_proj,))
        return o


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class ResLinAttention(nn.Module):
    """Full softmax attention (hybrid stacks): GQA, RoPE, optional sliding window, through SDPA."""

    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.attention_head_dim
        self.rope_theta = config.rope_theta
        self.sliding_window = config.sliding_window
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=config.attention_bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=config.attention_bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def rotary(self, position_ids, dtype):
        # Recomputed per call rather than kept as a buffer: cheap, and nothing to (re)initialise on load.
        exponent = torch.arange(0, self.head_dim, 2, device=position_ids.device, dtype=torch.float32) / self.head_dim
        freqs = position_ids[..., None].float() * self.rope_theta ** -exponent  # [B, T, D/2]
        angles = torch.cat([freqs, freqs], dim=-1)[:, None]  # [B, 1, T, D]
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def visibility(self, attention_mask, num_cached, T, device, cu_seqlens=None):
        """Boolean [B or 1, 1, T, num_cached + T] SDPA mask: causal, sliding window, padded keys,
        and with packed sequences only the query's own sequence."""
        query = torch.arange(T, device=device)[:, None] + num_cached
        key = torch.arange(num_cached + T, device=device)[None]
        visible = key <= query
        if cu_seqlens is not None:
            sequence = torch.searchsorted(cu_seqlens[1:], torch.arange(T, device=device), right=True)
            visible = visible & (sequence[:, None] == sequence[None, :])
        if self.sliding_window is not None:
            visible = visible & (query - key < self.sliding_window)
        visible = visible[None, None]
        if attention_mask is not None:
            visible = visible & attention_mask[:, None, None, -(num_cached + T):]
        # A padded query may see no key at all, which gives NaN; let it see every key instead:
        # its output only ever reaches padded positions, which later layers ignore.
        return visible | ~visible.any(-1, keepdim=True)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, cache=None, cu_seqlens=None, norm=None):
        """`norm`: the block's norm, applied to hidden_states here, or None where they are normed already."""
        B, T, _ = hidden_states.shape
        projections = (self.q_proj, self.k_proj, self.v_proj)
        q, k, v = (norm(hidden_states, projections) if norm is not None
                   else (projection(hidden_states) for projection in projections))
        q = q.view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = self.rotary(position_ids, q.dtype)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if cache is not None:
            k, v = cache.update_attention(self.layer_idx, k, v)
        o = self.attend(q, k, v, attention_mask, cu_seqlens)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, -1))

    def attend(self, q, k, v, attention_mask, cu_seqlens):
        """softmax(q k^T / sqrt(D)) v over what each query sees (`visibility`). Where that is only
        causality, within each packed sequence if any, SDPA's causal path serves (flash attention on
        CUDA) and no [T, T] mask is built: at 32K packed tokens the mask alone is 1 GB."""
        T, num_cached = q.shape[2], k.shape[2] - q.shape[2]
        sdpa = functools.partial(F.scaled_dot_product_attention, enable_gqa=self.num_kv_heads != self.num_heads)
        if attention_mask is None and self.sliding_window is None and num_cached == 0:
            if cu_seqlens is None:
                return sdpa(q, k, v, is_causal=True)
            if not torch.compiler.is_compiling():  # the sequences' bounds are read on the host
                bounds = sequence_bounds(cu_seqlens)
                return torch.cat([sdpa(q[:, :, start:end], k[:, :, start:end], v[:, :, start:end], is_causal=True)
                                  for start, end in zip(bounds[:-1], bounds[1:]) if end > start], dim=2)
        return sdpa(q, k, v, attn_mask=self.visibility(attention_mask, num_cached, T, q.device, cu_seqlens))


class ResLinMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]
        self.fused = uses_fused_layers(config) and config.hidden_act in ("silu", "swish")

    def forward(self, x, norm=None):
        """SwiGLU of x projected down; with `norm`, of norm(x), which gives the two projections' outputs
        itself (the fused path then keeps no normed copy of x for their weights' gradients)."""
        gate, up = norm(x, (self.gate_proj, self.up_proj)) if norm is not None else (self.gate_proj(x), self.up_proj(x))
        if runs_fused(self.fused, x):
            if is_plain_linear(self.down_proj):
                return fused_swiglu(gate, up, self.down_proj.weight)
            return self.down_proj(fused_swiglu(gate, up))
        return self.down_proj(self.act_fn(gate) * up)


def is_plain_linear(module):
    """A bias-free nn.Linear whose call runs only its own forward, so that its weight may be used
    directly: not a PEFT adapter's wrapper, no hooks, no forward replaced."""
    return type(module) is nn.Linear and module.bias is None and runs_only_its_forward(module)


class ResLinBlock(GradientCheckpointingLayer):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.attn_norm = ResLinRMSNorm(config.hidden_size, eps=config.norm_eps, fused=uses_fused_layers(config))
        if config.layer_types[layer_idx] == "linear_attention":
            self.attn = ResLinLinearAttention(config, layer_idx)
        else:
            self.attn = ResLinAttention(config, layer_idx)
        self.mlp_norm = ResLinRMSNorm(config.hidden_size, eps=config.norm_eps, fused=uses_fused_layers(config))
        self.mlp = ResLinMLP(config)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, cache=None, cu_seqlens=None):
        if self.takes_fused_decode_step(hidden_states, cache):
            return self.fused_decode_step(hidden_states, cache)
        hidden_states = hidden_states + self.attn(hidden_states, attention_mask, position_ids, cache, cu_seqlens,
                                                  norm=self.attn_norm)
        return hidden_states + self.mlp(hidden_states, self.mlp_norm)

    def takes_fused_decode_step(self, x, cache):
        """Whether this block's step runs `fused_decode_step`: one token of few rows on CUDA without
        autograd, a recurrent layer with its cached states in x's dtype, weights used as they are
        (plain bias-free nn.Linear layers: no adapters, hooks or offloading)."""
        if not (FUSED_DECODE_STEP and x.shape[1] == 1 and x.shape[0] <= FUSED_DECODE_MAX_ROWS and cache is not None
                and not torch.is_grad_enabled() and isinstance(self.attn, ResLinLinearAttention)
                and runs_fused(self.attn.fused and self.mlp.fused, x)):
            return False
        conv_states = cache.conv_states[self.attn.layer_idx]
        return (conv_states is not None
                and all(state.dtype == x.dtype and state.is_contiguous() for state in conv_states)
                and all(map(is_plain_linear, [*self.attn.projections(), self.attn.o_proj, self.mlp.gate_proj,
                                              self.mlp.up_proj, self.mlp.down_proj])))

    def fused_decode_step(self, hidden_states, cache):
        """The block at a generation step in five launches (ResLinLinearAttention.fused_decode_step,
        then the MLP's norm with its gate and up products and SwiGLU, and its down product with the
        residual add): the same operations as `forward`, rounded at the same points but for q and k,
        rounded before their L2 norm."""
        hidden_states = self.attn.fused_decode_step(hidden_states, self.attn_norm, cache)
        mlp, counters = self.mlp, cache.split_counters(hidden_states.device)
        up = rms_norm_swiglu(hidden_states, self.mlp_norm.weight, self.mlp_norm.eps, mlp.gate_proj.weight,
                             mlp.up_proj.weight, split_counters=counters)
        return linear_residual(up, mlp.down_proj.weight, hidden_states, split_counters=counters)


# Checkpoint names of earlier versions, the shipped model.safetensors among them (patterns of
# transformers' `key_mapping`): the input embedding was FLA's `model.embeddings`.
LEGACY_KEYS = {r"^model\.embeddings\.": "model.embed_tokens."}


class ResLinPreTrainedModel(PreTrainedModel):
    config_class = ResLinConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["ResLinBlock"]
    _input_embed_layer = "embed_tokens"
    _supports_sdpa = True

    @classmethod
    def _supports_default_dynamic_cache(cls):
        # transformers' DynamicCache cannot hold recurrent states: the model builds a ResLinCache.
        return False

    @classmethod
    def from_pretrained(cls, *args, key_mapping=None, **kwargs):
        # Folders saved before the input embedding took transformers' name load as they were saved.
        model = super().from_pretrained(*args, key_mapping={**LEGACY_KEYS, **(key_mapping or {})}, **kwargs)
        # transformers keeps the renamings it loaded with, to save under the loaded names again
        # (5.0 writes the pattern itself as the name): save under today's names.
        model._weight_conversions = [conversion for conversion in getattr(model, "_weight_conversions", None) or []
                                     if not set(getattr(conversion, "target_patterns", ())) & set(LEGACY_KEYS.values())]
        # Loading replaces parameter objects, which drops the flags set in __init__.
        for module in model.modules():
            if isinstance(module, ResLinLinearAttention):
                module.mark_no_weight_decay()
        return model

    def compile_blocks(self, **compile_kwargs):
        """torch.compile each ResLinBlock on its own, in place (PyTorch's regional compilation): every
        layer then runs the graph compiled for the first, where compiling the whole model traces
        each layer anew. The Triton kernels are custom ops inside those graphs."""
        for module in self.modules():
            if isinstance(module, ResLinBlock):
                module.compile(**compile_kwargs)

    def _init_weights(self, module):
        super()._init_weights(module)  # linear, conv and embedding weights normal(0, initializer_range), norms one
        if isinstance(module, ResLinLinearAttention):
            # Mamba2: A ~ U(0, 16); dt log-uniform in [1e-3, 1e-1], dt_bias = softplus^-1(dt).
            A = torch.empty_like(module.A_log, dtype=torch.float32).uniform_(0, 16)
            init.copy_(module.A_log, A.log())
            dt = torch.exp(torch.rand_like(A) * (math.log(0.1) - math.log(0.001)) + math.log(0.001)).clamp(min=1e-4)
            init.copy_(module.dt_bias, dt + torch.log(-torch.expm1(-dt)))
            if module.step_rule == "kaczmarz":
                # Raw keys: their scale sets the Kaczmarz step eta / ||k||^2 and how large a stored value
                # reads back, so it must be of order 1 at init (std-0.02 taps gave ~0.004).
                init.normal_(module.k_conv1d.weight, std=raw_key_tap_std(self.config))


def raw_key_tap_std(config):
    """The std of `k_conv1d`'s taps that gives a raw key (KLA, RKLA) an expected squared norm of about 1
    per head at initialisation, whatever the sizes (the KLA authors' PyTorch-default initialisation gives
    about 3 at their shapes). The layer's input is RMS-normed, so a k_proj output has variance
    hidden_size * std^2; conv_size taps of variance s^2 make the convolution's output variance
    conv_size * s^2 * hidden_size * std^2; SiLU(y) ~ y / 2 for small y, so a variance of 4 / head_dim
    gives E||k||^2 = 1 + 3 / head_dim (SiLU's next term)."""
    projection_std = config.initializer_range or 0.02  # k_proj's std in PreTrainedModel._init_weights
    return 2 / (projection_std * math.sqrt(config.conv_size * config.hidden_size * config.head_dim))


def is_decode_step(cache, num_tokens):
    """A generation step: one token per row, continuing a cache that has seen tokens."""
    return num_tokens == 1 and cache is not None and cache.get_seq_length() > 0


class ResLinModel(ResLinPreTrainedModel):
    def __init__(self, config):
        # Again here: from_pretrained(..., field=value) sets fields after the config's own checks ran.
        config.validate()
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList([ResLinBlock(config, i) for i in range(config.num_hidden_layers)])
        self.norm = ResLinRMSNorm(config.hidden_size, eps=config.norm_eps, fused=uses_fused_layers(config))
        # The layers take their kernels when built (which are fused, which backend): a later
        # assignment to config.kernel_backend would go unread, so forward refuses it.
        self.kernel_backend = config.kernel_backend
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        cache=None,
        inputs_embeds=None,
        use_cache=None,
        output_hidden_states=None,
        return_dict=None,
        past_key_values=None,
        **kwargs,
    ):
        cache = resolve_cache_keyword(cache, past_key_values, kwargs)
        if self.config.kernel_backend != self.kernel_backend:
            raise ValueError(f"config.kernel_backend was set to {self.config.kernel_backend!r} after the model was "
                             f"built with {self.kernel_backend!r}: the layers choose their kernels when built, so "
                             f"pass it when loading (from_pretrained(path, kernel_backend=...))")
        # Training needs no cache by default (FLA's models do the same): it would only ask the
        # kernels for final states nobody reads.
        use_cache = use_cache if use_cache is not None else self.config.use_cache and not self.training
        output_hidden_states = (
            output_hidden_states if output_hidden_states is not None else self.config.output_hidden_states
        )
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        output_attentions = kwargs.get("output_attentions")
        if output_attentions if output_attentions is not None else self.config.output_attentions:
            logger.warning_once("ResLin models return no attention weights (`attentions` is None): the recurrent "
                                "layers have none, and the full attention layers run SDPA, which gives none.")
        B, T = check_model_inputs(self.config, input_ids, inputs_embeds, position_ids, cache,
                                  embedding_dtype=self.embed_tokens.weight.dtype)

        if any(layer.gradient_checkpointing for layer in self.layers) and self.training and torch.is_grad_enabled():
            # The backward replay would read states the forward already advanced.
            if use_cache or cache is not None:
                logger.warning_once("A cache is incompatible with gradient checkpointing in training: not using one.")
            use_cache, cache = False, None
        past = cache.get_seq_length() if cache is not None else 0
        # A generation step's token and mask come from checked ones (generate samples the token and
        # extends the mask with ones): only shapes are checked then, since reading values syncs the
        # device at every token. An out-of-range token still fails, in the embedding lookup (on CUDA
        # as a device-side assertion).
        decode_step = is_decode_step(cache, T)
        if input_ids is not None and not decode_step:
            check_token_values("input_ids", input_ids, self.config.vocab_size)
        if attention_mask is not None:
            attention_mask = check_attention_mask(attention_mask, B, past + T, check_values=not decode_step)
        # position_ids restarting at 0 mean packed sequences only in a fresh, unpadded row: with
        # padding or a cache they are positions of one sequence.
        device = (input_ids if input_ids is not None else inputs_embeds).device
        cu_seqlens = packed_sequences(position_ids, kwargs.get("cu_seq_lens_q"), B, T, device,
                                      detect=cache is None and attention_mask is None)
        if cu_seqlens is not None:
            if cache is not None:
                raise ValueError("packed sequences (position_ids restarting at 0, or cu_seq_lens_q) cannot use a cache")
            if attention_mask is not None:
                raise ValueError("packed sequences take no padding: pass an all-ones attention_mask or none")
            if position_ids is None:  # cu_seq_lens_q alone: the positions restart at each sequence's start
                tokens = torch.arange(T, device=device)
                position_ids = (tokens - cu_seqlens[torch.searchsorted(cu_seqlens, tokens, right=True) - 1])[None]
            use_cache = False  # their final states are not a batch a cache could continue
        if cache is None and use_cache:
            cache = ResLinCache(self.config, B)

        hidden_states = all_hidden_states = None
        # Stacks with attention layers decode eagerly: their key/value caches grow at every step.
        if (decode_step and input_ids is not None and "full_attention" not in self.config.layer_types
                and not output_hidden_states and not torch.is_grad_enabled()):
            hidden_states = self.decode_with_graph(input_ids, cache)
        if hidden_states is None:
            if input_ids is not None:
                inputs_embeds = self.embed_tokens(input_ids)
            if position_ids is None and "full_attention" in self.config.layer_types:
                if attention_mask is not None:
                    # Count only real tokens, so RoPE matches the unpadded sequence.
                    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -T:]
                else:
                    position_ids = torch.arange(past, past + T, device=inputs_embeds.device).expand(B, T)
            hidden_states, all_hidden_states = self.run_layers(inputs_embeds, attention_mask, position_ids, cache,
                                                               cu_seqlens, output_hidden_states)
        if cache is not None:
            cache.advance(T)

        output = BaseModelOutputWithPast(last_hidden_state=hidden_states, hidden_states=all_hidden_states,
                                         **{CACHE_FIELD: cache})
        return output if return_dict else output.to_tuple()

    def run_layers(self, hidden_states, attention_mask, position_ids, cache, cu_seqlens, output_hidden_states):
        """The blocks and the final norm: (last hidden state, every hidden state or None)."""
        all_hidden_states = (hidden_states,) if output_hidden_states else None
        for layer in self.layers:
            hidden_states = layer(hidden_states, attention_mask, position_ids, cache=cache, cu_seqlens=cu_seqlens)
            if output_hidden_states:
                all_hidden_states += (hidden_states,)
        hidden_states = self.norm(hidden_states)
        if output_hidden_states:
            all_hidden_states = all_hidden_states[:-1] + (hidden_states,)
        return hidden_states, all_hidden_states

    def decode_with_graph(self, input_ids, cache):
        """A generation step from the cache's CUDA graph (generation_reslin.ResLinDecodeGraph),
        captured at its first step; None, to run eagerly, where a graph cannot run there."""
        graph = cache.decode_graph
        if graph is not None and graph.serves(self):
            # A copy: the next replay overwrites the graph's output, and the caller may keep this step's.
            return graph.replay(input_ids).clone()
        if not graph_can_run(self, cache, input_ids.device):
            return None
        cache.decode_graph = None  # release a stale graph's memory before capturing anew

        def step(input_ids):
            return self.run_layers(self.embed_tokens(input_ids), None, None, cache, None, False)[0]

        hidden_states, cache.decode_graph = ResLinDecodeGraph.capture(self, step, input_ids)
        return hidden_states


def packed_sequences(position_ids, cu_seq_lens_q, batch_size, length, device, detect):
    """cu_seqlens [N + 1] of packed sequences in one row, or None. transformers' padding-free
    collator (DataCollatorWithFlattening) marks them by position_ids that restart at 0 (looked
    for when `detect`), or passes cu_seq_lens_q (return_flash_attn_kwargs=True), with or without
    position_ids."""
    if cu_seq_lens_q is None:
        if not detect or position_ids is None or batch_size != 1:
            return None
        starts = (position_ids[0] == 0).nonzero().flatten()
        if len(starts) < 2 or starts[0] != 0:
            return None
        cu_seq_lens_q = torch.cat([starts, starts.new_tensor([length])])
    if batch_size != 1:
        raise ValueError(f"packed sequences come in one row (batch size 1), got batch size {batch_size}")
    return cu_seq_lens_q.to(device=device, dtype=torch.long)


class ChunkedCrossEntropy(torch.autograd.Function):
    """The summed cross-entropy of logits [N, V] against targets [N] (`ignore_index` skipped), in
    fp32 one block of rows at a time. It keeps for the backward only the logits themselves, which
    the model returns anyway, and a log-sum-exp per row: cross-entropy on logits cast to fp32
    keeps an fp32 copy and an fp32 log-softmax, 2 GB each at 16K tokens and a 32K vocabulary."""

    BLOCK_ELEMENTS = 2 ** 25  # fp32 elements of one block of rows (128 MB)

    @staticmethod
    def forward(ctx, logits, targets, ignore_index):
        kept = targets != ignore_index
        targets = targets.where(kept, 0)
        rows = max(1, ChunkedCrossEntropy.BLOCK_ELEMENTS // logits.shape[1])
        log_sum_exp = torch.cat([torch.logsumexp(block.float(), dim=-1) for block in logits.split(rows)])
        target_logits = logits.gather(1, targets[:, None])[:, 0].float()
        ctx.save_for_backward(logits, targets, kept, log_sum_exp)
        return ((log_sum_exp - target_logits) * kept).sum()

    @staticmethod
    def backward(ctx, grad):
        logits, targets, kept, log_sum_exp = ctx.saved_tensors
        rows = max(1, ChunkedCrossEntropy.BLOCK_ELEMENTS // logits.shape[1])
        dlogits = torch.empty_like(logits)
        # d loss / d logits = (softmax - onehot(target)) per kept row, zero elsewhere: with every label
        # ignored the mean's grad is 1/0, and inf * 0 would make every gradient NaN.
        weight = torch.where(kept, grad, 0.0)
        for start in range(0, logits.shape[0], rows):
            block = slice(start, start + rows)
            probabilities = torch.exp(logits[block].float() - log_sum_exp[block, None])
            probabilities.scatter_add_(1, targets[block, None], probabilities.new_full((probabilities.shape[0], 1), -1.0))
            dlogits[block] = probabilities * weight[block, None]
        return dlogits, None, None


def causal_lm_loss(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, shift_labels=None,
                   **kwargs):
    """transformers' ForCausalLMLoss (the next-token cross-entropy in fp32, with its `shift_labels`
    and `num_items_in_batch`) through ChunkedCrossEntropy."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    targets = shift_labels.reshape(-1).to(logits.device)
    total = ChunkedCrossEntropy.apply(logits.reshape(-1, vocab_size), targets, ignore_index)
    if num_items_in_batch is None:
        return total / (targets != ignore_index).sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def requests_assisted_decoding(generation_config, generate_kwargs):
    """Whether generate(**generate_kwargs) would decode with an assistant, by transformers' own rule
    (GenerationConfig.get_generation_mode), to which versions add triggers (5.25: `use_mtp`)."""
    config = copy.deepcopy(generation_config)
    for name, value in generate_kwargs.items():
        # As generate applies its keyword settings; GenerationConfig.update would also warn about them.
        if hasattr(config, name):
            setattr(config, name, value)
    return config.get_generation_mode(generate_kwargs.get("assistant_model")) == GenerationMode.ASSISTED_GENERATION


def resolve_cache_keyword(cache, past_key_values, kwargs=None):
    """The cache under any name it is passed by: `cache` (transformers 5.24's generate),
    `past_key_values` (5.17's, and most models'), `cache_params` (Mamba's) or `past_key_value`
    (older models'). The last two are taken out of `kwargs`, where they would go unread."""
    others = () if kwargs is None else (kwargs.pop("cache_params", None), kwargs.pop("past_key_value", None))
    given = [c for c in (cache, past_key_values, *others) if c is not None]
    if any(c is not given[0] for c in given[1:]):
        raise ValueError("Pass the cache under one name (`cache`, `past_key_values`, `cache_params` or "
                         "`past_key_value`), not two different ones")
    return given[0] if given else None


class ResLinForCausalLM(ResLinPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    # Read by transformers' generate up to 5.24 (see `generate` below), and by other tools that ask
    # whether a model's past can be cropped.
    _is_stateful = True

    def __init__(self, config):
        super().__init__(config)
        self.model = ResLinModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        cache=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        output_hidden_states=None,
        return_dict=None,
        logits_to_keep=0,
        past_key_values=None,
        **kwargs,
    ):
        """`labels` [B, T] give the next-token cross-entropy (shifted inside, -100 ignored).
        `logits_to_keep`: an int keeps the logits of that many last positions (0 = all), a tensor
        selects positions."""
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        cache = resolve_cache_keyword(cache, past_key_values, kwargs)
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_hidden_states=output_hidden_states,
            return_dict=True,
            **kwargs,  # e.g. cu_seq_lens_q of transformers' padding-free collator
        )
        hidden_states = outputs.last_hidden_state
        check_logits_to_keep(logits_to_keep, hidden_states.shape[1])
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden_states[:, keep, :])
        loss = None
        if labels is not None:
            for name, value in (("labels", labels), ("shift_labels", kwargs.get("shift_labels"))):
                if value is not None:
                    check_labels(name, value, tuple(hidden_states.shape[:2]), logits.shape[1], self.config.vocab_size,
                                 kwargs.get("ignore_index", -100))
            # Under torch.compile transformers' own loss: inductor fuses it without the fp32 copies.
            loss_function = self.loss_function if torch.compiler.is_compiling() else causal_lm_loss
            loss = loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        output = CausalLMOutputWithPast(loss=loss, logits=logits, hidden_states=outputs.hidden_states,
                                        **{CACHE_FIELD: outputs[CACHE_FIELD] if CACHE_FIELD in outputs else None})
        return output if return_dict else output.to_tuple()

    def generate(self, inputs=None, generation_config=None, **kwargs):
        """GenerationMixin.generate, after checking the prompt (malformed ones fail in transformers'
        preparation with errors that name something else) and refusing assisted and speculative decoding
        (`assistant_model`, `prompt_lookup_num_tokens`, ...): checking draft tokens needs the
        recurrent state rolled back to the last accepted one, which a ResLinCache cannot do.
        transformers refused them for stateful models itself up to 5.24; 5.25 fails later, with
        "Assisted decoding requires a cache"."""
        check_prompt(self.config, kwargs.get("input_ids") if inputs is None else inputs, kwargs.get("inputs_embeds"),
                     kwargs.get("attention_mask"))
        if requests_assisted_decoding(self.generation_config if generation_config is None else generation_config,
                                      kwargs):
            raise ValueError(f"{type(self).__name__} cannot run assisted or speculative decoding (assistant_model, "
                             f"prompt_lookup_num_tokens, assistant_early_exit, ...): rejecting a draft token would "
                             f"need the recurrent state rolled back, which ResLin's cache cannot do. Generate "
                             f"without them.")
        return super().generate(inputs, generation_config, **kwargs)

    def release_generation_graph(self):
        """Free the CUDA graph of a generation step, and the copy of the recurrent states it runs on,
        that generate keeps for this model's next call (the next call captures again)."""
        release_kept_step(self)

    def _sample(self, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
                streamer=None, **model_kwargs):
        """Greedy decoding and sampling: ResLin's own loop (generation_reslin.DeviceDecoding, the
        same tokens with the host reading them every few steps) where it takes the settings,
        transformers' otherwise."""
        decoding = DeviceDecoding.plan(self, logits_processor, stopping_criteria, generation_config, synced_gpus,
                                       model_kwargs)
        if decoding is None:
            return super()._sample(input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus,
                                   streamer, **model_kwargs)
        return decoding.run(self, input_ids, generation_config, streamer, model_kwargs)

    def prepare_inputs_for_generation(self, input_ids, inputs_embeds=None, **kwargs):
        # (generate checks this signature for `inputs_embeds` before it accepts them.)
        model_inputs = super().prepare_inputs_for_generation(input_ids, inputs_embeds=inputs_embeds, **kwargs)
        # generate trims a continued prompt to the tokens the cache has not seen only when some layer
        # is not linear (5.24), or only for a cache passed as `past_key_values` (5.17): trim here in every
        # case, from the mask, which covers all tokens, or else from the ids. A prompt given as
        # embeddings is all new; the ids generated after it cover fewer tokens than the cache has seen,
        # of which only the last is new.
        cache = resolve_cache_keyword(model_inputs.get("cache"), model_inputs.get("past_key_values"))
        attention_mask = model_inputs.get("attention_mask")
        if cache is not None and model_inputs.get("inputs_embeds") is None:
            total_tokens = (attention_mask if attention_mask is not None else input_ids).shape[1]
            new_tokens = max(total_tokens - cache.get_seq_length(), 1)
            for name in ("input_ids", "position_ids"):
                value = model_inputs.get(name)
                if value is not None and value.shape[-1] > new_tokens:
                    model_inputs[name] = value[..., value.shape[-1] - new_tokens:]
        return model_inputs


# save_pretrained copies this file and its `from .x import` siblings only for registered classes.
ResLinModel.register_for_auto_class("AutoModel")
ResLinForCausalLM.register_for_auto_class("AutoModelForCausalLM")
# The Trainer's label smoothing shifts the labels only for the class names in this table (no remote-code
# class is there): without the entry each position would be trained to predict its own token.
MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.setdefault(ResLinConfig.model_type, ResLinForCausalLM.__name__)

__all__ = ["ResLinPreTrainedModel", "ResLinModel", "ResLinForCausalLM"]
