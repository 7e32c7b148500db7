"""ResLinCache: the generation cache of ResLin models.

Per layer it holds what the next tokens need:
- linear attention layers: the last `conv_size - 1` inputs of the q, k and v short convolutions
  and the recurrent states S (and R with the residual rule), fp32 [B, HV, Dk, Dv];
- full attention layers: keys and values [B, kv_heads, L, head_dim], only the last
  `sliding_window - 1` positions when the layer has a sliding window.

It is a self-contained class rather than a `transformers.cache_utils.Cache` subclass: the
`Cache` base changed between transformers 5.17 and 5.24 and assumes per-layer key/value
tensors, while generate only needs the handful of members defined here. A recurrent state
cannot be rolled back without keeping every intermediate state, so the cache cannot be
cropped: assisted and speculative decoding are refused.

Once a linear attention layer's states exist they stay where they are: later tokens and beam
search overwrite them in place. A CUDA graph of a generation step (`decode_graph`, captured by
modeling_reslin) reads and writes them at those addresses.
"""

import torch

# The fused products split K only for fewer tiles of outputs than kernels_reslin_triton_gemv's
# PROGRAMS_TO_FILL (256), a counter a tile: room to spare.
SPLIT_COUNTERS = 1024


def tensor_identity(x):
    """Where a tensor lies and how often it was modified in place since it was made: equal
    identities, the same values. A tensor made under torch.inference_mode tracks no modifications
    (only code inside inference_mode can modify it, untracked): its place alone."""
    return x.data_ptr(), None if x.is_inference() else x._version


class ResLinCache:
    # generate reads these: no static shapes to compile against, no rollback.
    is_compileable = False
    is_croppable = False

    def __init__(self, config, batch_size):
        self.layer_types = list(config.layer_types)
        self.batch_size = batch_size
        self._signature = self.signature(config)
        num_layers = len(self.layer_types)
        self.conv_states = [None] * num_layers  # (q, k, v) conv inputs, each [B, D, conv_size - 1]
        self.recurrent_states = [None] * num_layers  # (S, R), R None without the residual rule
        self.key_cache = [None] * num_layers
        self.value_cache = [None] * num_layers
        self.sliding_window = config.sliding_window
        self._seen_tokens = 0
        # generation_reslin.ResLinDecodeGraph: a generation step captured against this cache's states.
        self.decode_graph = None
        self.side_by_side = {}  # layer -> (the weights' identity, their concatenation)
        self.split_counters_by_device = {}  # device -> its `split_counters`

    @staticmethod
    def signature(config):
        """Everything about a model that fixes the shapes this cache holds."""
        return (
            tuple(config.layer_types),
            ("linear", config.num_heads, config.head_dim, config.num_v_heads, config.head_v_dim,
             config.conv_size, config.use_residual),
            ("attention", config.num_key_value_heads, config.attention_head_dim, config.sliding_window),
        )

    def check_compatible(self, config, batch_size):
        if self.signature(config) != self._signature:
            raise ValueError(
                "This ResLinCache was built for another model (layer types, head counts, head sizes, conv size, "
                f"residual state or sliding window differ): cache {self._signature}, model {self.signature(config)}. "
                "Pass cache=None to let the model build its own.")
        if batch_size != self.batch_size:
            raise ValueError(f"This ResLinCache holds a batch of {self.batch_size} sequences but the input has "
                             f"{batch_size} rows")

    @property
    def is_linear(self):
        # generate (5.24) reads this to decide whether its attention-mask helpers apply.
        return [layer_type == "linear_attention" for layer_type in self.layer_types]

    def get_seq_length(self, layer_idx=0):
        """Number of tokens the cache has seen (padding included), the same for every layer."""
        return self._seen_tokens

    def advance(self, num_tokens):
        """Called by the model once per forward, after every layer has updated its entry."""
        self._seen_tokens += num_tokens

    def update_linear(self, layer_idx, conv_states, recurrent_states):
        """Store a linear attention layer's new states: `conv_states` (q, k, v) and
        `recurrent_states` (S, R), R None without the residual rule.

        The first states a layer gets are kept, and later ones are copied into them, so that
        they never move (see the module docstring). Under autograd they are replaced instead,
        since an earlier step's backward may still need the old values; a decode graph, which
        would write to the old tensors, is dropped then.
        """
        held = self.conv_states[layer_idx]
        if held is None or torch.is_grad_enabled():
            # Contiguous copies: a convolution's window is a view of its whole input, which would stay alive.
            self.conv_states[layer_idx] = tuple(x.contiguous() for x in conv_states)
            self.recurrent_states[layer_idx] = tuple(None if x is None else x.contiguous() for x in recurrent_states)
            self.decode_graph = None
            return
        for old, new in zip(held + self.recurrent_states[layer_idx], conv_states + recurrent_states):
            if new is not old:  # the decode step advances S and R in place already
                old.copy_(new)

    def side_by_side_weight(self, layer_idx, weights):
        """`weights` [N_i, K] concatenated into [sum N_i, K] for a generation step's one product over
        a layer's projections: made at the layer's first step and kept while this cache lives and the
        weights stay the same tensors, unmodified (about a quarter of a recurrent model's weights).
        A captured step reads the copy where it lay at capture, so a new copy drops the graph.
        Returns (the copy, whether it was made by this call: its launch is then the last one)."""
        identity = tuple(map(tensor_identity, weights))
        held = self.side_by_side.get(layer_idx)
        made_now = held is None or held[0] != identity
        if made_now:
            held = self.side_by_side[layer_idx] = (identity, torch.cat(weights))
            self.decode_graph = None
        return held[1], made_now

    def split_counters(self, device):
        """The generation step's split counters on `device` (kernels_reslin_triton_gemv): int32
        zeros, made at the first step, that each of the step's products leaves at zero. A step's
        launches run in turn, so one set a device serves them all; a captured step reads them where
        they lay at capture."""
        device = torch.device(device)
        if device not in self.split_counters_by_device:
            self.split_counters_by_device[device] = torch.zeros(SPLIT_COUNTERS, dtype=torch.int32, device=device)
        return self.split_counters_by_device[device]

    def swap_step_states(self, held):
        """Exchange what a generation step reads and writes, (conv_states, recurrent_states,
        side_by_side, split counters), with `held`, of a cache of the same shapes; returns this
        cache's. generation_reslin lends a generate call's cache the states of a kept step graph
        this way."""
        own = (self.conv_states, self.recurrent_states, self.side_by_side, self.split_counters_by_device)
        self.conv_states, self.recurrent_states, self.side_by_side, self.split_counters_by_device = held
        return own

    def update_attention(self, layer_idx, keys, values):
        """Append this step's keys/values [B, kv_heads, T, D]; return the cached ones followed by them."""
        if self.key_cache[layer_idx] is not None:
            keys = torch.cat([self.key_cache[layer_idx], keys], dim=2)
            values = torch.cat([self.value_cache[layer_idx], values], dim=2)
        # A query sees itself and the `sliding_window - 1` positions before it: older ones are never read again.
        keep = keys.shape[2] if self.sliding_window is None else self.sliding_window - 1
        self.key_cache[layer_idx] = keys[:, :, keys.shape[2] - keep:]
        self.value_cache[layer_idx] = values[:, :, values.shape[2] - keep:]
        return keys, values

    def held_states(self):
        """Every state tensor held (convolution inputs, recurrent states, keys and values)."""
        return [x for i in range(len(self.layer_types))
                for x in (*(self.conv_states[i] or ()), *(self.recurrent_states[i] or ()), self.key_cache[i],
                          self.value_cache[i]) if x is not None]

    def save_states(self, saved=None):
        """A copy of the states and of the token count, for `restore_states`; into `saved`, an
        earlier save of this cache, when given (no new memory). For a cache whose layers are all
        recurrent: keys and values grow, and a save of them would not fit a later step."""
        if any(layer_type != "linear_attention" for layer_type in self.layer_types):
            raise ValueError("save_states takes a cache of recurrent layers only")
        states = self.held_states()
        if saved is None:
            return self._seen_tokens, [x.clone() for x in states]
        torch._foreach_copy_(saved[1], states)
        return self._seen_tokens, saved[1]

    def restore_states(self, saved):
        """Put back the states and the token count of `save_states`, in place."""
        self._seen_tokens, copies = saved
        torch._foreach_copy_(self.held_states(), copies)

    def reorder_cache(self, beam_idx):
        """Beam search: row i continues from row beam_idx[i], in place (the states do not move)."""
        if tuple(beam_idx.shape) != (self.batch_size,):
            raise ValueError(f"beam_idx must name one source row for each of the cache's {self.batch_size} rows, "
                             f"got shape {tuple(beam_idx.shape)}")
        for x in self.held_states():
            x.copy_(x.index_select(0, beam_idx.to(x.device)))

    def crop(self, max_length):
        raise NotImplementedError(
            "ResLinCache cannot be cropped: a recurrent state cannot be rolled back to an earlier token. "
            "Assisted / speculative decoding (assistant_model, prompt_lookup_num_tokens) is not supported.")

    def activate_past_recording(self):
        raise NotImplementedError(
            "ResLinCache cannot record past states for rollback: assisted / speculative decoding "
            "(assistant_model, prompt_lookup_num_tokens) is not supported by ResLin models.")


__all__ = ["ResLinCache", "tensor_identity"]
