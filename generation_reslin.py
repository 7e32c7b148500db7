"""Generation machinery of ResLin models: the CUDA graph of a step, and `generate`'s own loop.

transformers' loop (GenerationMixin._sample) runs each step from Python and reads every chosen
token and the stop decision on the host: one device sync a token, and about a millisecond of host
time a token that a small model's step on a GPU does not hide. `DeviceDecoding` runs the same
steps with the token chosen on the device. A step (the layers, the logits' processing, the
choice, the end-of-sequence bookkeeping) writes its token where the next step reads it, so on
CUDA one graph is replayed back to back, and the host reads the tokens every `TOKENS_PER_SYNC`
steps. It takes only what it reproduces exactly: greedy decoding and sampling with temperature,
top-k, top-p, min-p and minimum lengths, stopped by a length and end-of-sequence ids. The
logits, the processors (transformers' own objects) and the draw (torch.multinomial's exponential
race, from the same generator, once a token) are those of transformers' loop, so the tokens are
too, and so is the random state it leaves. Anything else runs transformers' loop.

A call's first step captures the step's graph (tens of milliseconds: the step runs once for real,
then again under capture). The graph and the states it was captured against are kept for the
model's next call of the same batch size and settings (`KeptStep`): that call's cache lends its
states to the graph's for the call, so a chat's or a server's later calls replay from their first
step. `ResLinForCausalLM.release_generation_graph()` frees what is kept.
"""

import itertools
import threading
import weakref
from dataclasses import fields

import torch
import torch.nn.functional as F
from transformers.generation.logits_process import (
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria
from transformers.generation.utils import GenerateDecoderOnlyOutput
from transformers.modeling_outputs import CausalLMOutputWithPast

try:
    from .cache_reslin import tensor_identity
except ImportError:
    from cache_reslin import tensor_identity

# Inside a try block: without Triton the torch code chooses the tokens (see kernels_reslin_triton_launch).
try:
    try:
        from . import kernels_reslin_triton_gemv as triton_gemv, kernels_reslin_triton_launch as triton_launch
        from .kernels_reslin_triton_choice import MAX_ROWS as GREEDY_CHOICE_MAX_ROWS, greedy_choice
    except ImportError:
        import kernels_reslin_triton_gemv as triton_gemv
        import kernels_reslin_triton_launch as triton_launch
        from kernels_reslin_triton_choice import MAX_ROWS as GREEDY_CHOICE_MAX_ROWS, greedy_choice
except ImportError:
    greedy_choice = GREEDY_CHOICE_MAX_ROWS = triton_gemv = triton_launch = None

# transformers 5.24 renamed the outputs' `past_key_values` field to `cache`; generate reads the
# cache back under the name its own output classes declare.
CACHE_FIELD = "cache" if "cache" in {f.name for f in fields(CausalLMOutputWithPast)} else "past_key_values"
GENERATE_CACHE_FIELD = "cache" if "cache" in {f.name for f in fields(GenerateDecoderOnlyOutput)} else "past_key_values"

# Steps between two reads of the tokens by the host. The loop may run up to this many steps
# past the last sequence's end, whose tokens it drops (at 2,000 tokens/s, 8 ms); a streamer
# receives tokens in bursts of this many.
TOKENS_PER_SYNC = 16
# Processors that read nothing but the scores: called as they are, inside a CUDA graph too.
SCORE_PROCESSORS = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper)
# Options whose outputs the loop does not collect.
PER_STEP_OUTPUTS = ("output_scores", "output_logits", "output_attentions", "output_hidden_states")
# Greedy choice on CUDA in two Triton launches (kernels_reslin_triton_choice) where the torch code
# takes ten to twenty; False: the torch code everywhere.
FUSED_GREEDY_CHOICE = True
# New tokens a call's buffers hold at least (their steps write token i at column i): calls of up to
# this many share a kept graph.
KEPT_MIN_TOKENS = 1024


class ResLinDecodeGraph:
    """A generation step captured in a CUDA graph, replayed at later steps.

    Eagerly, a step launches dozens of small kernels a layer from Python, which costs a deep model
    far more time than running them; a replay launches the whole step at once. The graph reads its
    inputs from its own buffers (`inputs`), and the weights and the cache's states at the addresses
    they had at capture. That holds because the cache advances and reorders its states in place
    (and drops a graph it holds when it cannot, under autograd), and because the graph notes its
    model and where the model's input embedding lay: a graph is not used for another model, or for
    a model moved or cast since. What a replay cannot see: parameters or modules replaced one by
    one between two steps. `config.decode_cuda_graphs = False` runs every step eagerly.
    """

    def __init__(self, model, step, inputs, stream):
        self.model = weakref.ref(model)
        self.weights = model.get_input_embeddings().weight.data_ptr()
        self.inputs = tuple(x.clone() for x in inputs)
        self.graph = torch.cuda.CUDAGraph()
        # Captured as torch.cuda.graph captures, less its torch.cuda.empty_cache(): that hands every
        # cached block back to the driver, and a generate call, which captures once, would pay the
        # frees and then the mallocs of its next steps' tensors. thread_local, as torch.compile's
        # CUDA graphs: CUDA work of other threads (another generation, say) neither breaks the
        # capture nor is refused during it.
        with torch.cuda.stream(stream):
            self.graph.capture_begin(capture_error_mode="thread_local")
            try:
                self.output = step(*self.inputs)
            finally:
                self.graph.capture_end()

    @classmethod
    def capture(cls, model, step, *inputs):
        """Run `step(*inputs)` once for real, then capture it: (its output, the graph).

        The real run is the warm-up that capture needs (lazy set-ups such as Triton's compilation
        and cuBLAS's workspace must not happen during capture), on the side stream the capture
        then uses. It is the step's first run; the capture itself runs nothing."""
        device = next(model.parameters()).device
        with torch.cuda.device(device):
            current, side = torch.cuda.current_stream(), torch.cuda.Stream()
            side.wait_stream(current)
            with torch.cuda.stream(side):
                output = step(*inputs)
            graph = cls(model, step, inputs, side)
            current.wait_stream(side)
            if output is not None:
                output.record_stream(current)  # made on the side stream, read on this one
        return output, graph

    def serves(self, model):
        return self.model() is model and model.get_input_embeddings().weight.data_ptr() == self.weights

    def replay(self, *inputs):
        """Replay with `inputs` copied into the graph's buffers; returns the graph's own output
        tensor, which the next replay overwrites."""
        for buffer, x in zip(self.inputs, inputs):
            buffer.copy_(x)
        self.graph.replay()
        return self.output


def runs_only_its_forward(module):
    """Whether calling `module` runs only its class's forward: no hooks (its own or global ones),
    no forward replaced on the instance (accelerate's offloading replaces it). Code that reaches
    past the module to its parts or its weights may do so only then."""
    return not (module._forward_hooks or module._forward_pre_hooks or "forward" in vars(module)
                or torch.nn.modules.module._global_forward_hooks
                or torch.nn.modules.module._global_forward_pre_hooks)


def embed(embedding, token):
    """embedding(token), by indexing its weight where it is a plain nn.Embedding: F.embedding's
    kernel for a few rows (index_select's for small indices) walks the rows one after another in
    each thread, 12 us a step at 16 rows on an H100 against 2 at one (bench_generate.py --top)."""
    if type(embedding) is torch.nn.Embedding and embedding.max_norm is None and runs_only_its_forward(embedding):
        return embedding.weight[token]
    return embedding(token)


def graph_can_run(model, cache, device):
    """Whether a generation step of `model` on `device` may be captured: every weight and every
    recurrent state there (not a cache filled elsewhere, nor a model split across devices or
    offloaded), outside compilation and outside another capture."""
    return (device.type == "cuda" and model.config.decode_cuda_graphs and not torch.compiler.is_compiling()
            and not torch.cuda.is_current_stream_capturing()
            and all(state is not None and state[0].device == device for state in cache.recurrent_states)
            and all(p.device == device for p in model.parameters()))


class RandomState:
    """The state of the generator that sampling on `device` draws from, saved and put back."""

    def __init__(self, device):
        self.device = device
        self.state = None

    def save(self):
        if self.device.type == "cpu":
            self.state = torch.get_rng_state()
        else:
            self.state = torch.get_device_module(self.device).get_rng_state(self.device)

    def restore(self):
        if self.device.type == "cpu":
            torch.set_rng_state(self.state)
        else:
            torch.get_device_module(self.device).set_rng_state(self.state, self.device)


class DeviceDecoding:
    """GenerationMixin._sample's loop for a ResLinForCausalLM whose layers are all recurrent, with
    the token chosen on the device (module docstring). Built by `plan`, which returns None where
    the settings need transformers' loop; `run` then takes _sample's arguments."""

    def __init__(self, do_sample, processors, max_length, eos_token_id, pad_token_id):
        self.do_sample = do_sample
        self.processors = processors  # score processors, and (min_length, eos ids) masks, in order
        self.max_length = max_length
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id

    @classmethod
    def plan(cls, model, logits_processor, stopping_criteria, generation_config, synced_gpus, model_kwargs):
        config = model.config
        if (not config.generate_fast_path or synced_gpus or getattr(generation_config, "is_assistant", False)
                or "full_attention" in config.layer_types or not model_kwargs.get("use_cache", True)):
            return None
        # A step calls the layers and lm_head itself, past the two models' forwards.
        if not (runs_only_its_forward(model) and runs_only_its_forward(model.model)):
            return None
        if generation_config.return_dict_in_generate and any(getattr(generation_config, name, False)
                                                             for name in PER_STEP_OUTPUTS):
            return None
        processors = []
        for processor in logits_processor:
            if type(processor) in SCORE_PROCESSORS:
                processors.append(processor)
            elif type(processor) is MinLengthLogitsProcessor:
                processors.append((processor.min_length, processor.eos_token_id))
            elif type(processor) is MinNewTokensLengthLogitsProcessor:
                processors.append((processor.prompt_length_to_skip + processor.min_new_tokens, processor.eos_token_id))
            else:
                return None
        max_length, eos_token_id = None, None
        for criterion in stopping_criteria:
            if type(criterion) is MaxLengthCriteria:
                max_length = criterion.max_length if max_length is None else min(max_length, criterion.max_length)
            elif type(criterion) is EosTokenCriteria:
                ids = criterion.eos_token_id.flatten()
                eos_token_id = ids if eos_token_id is None else torch.cat([eos_token_id, ids.to(eos_token_id.device)])
            else:
                return None
        pad_token_id = generation_config._pad_token_tensor
        if max_length is None or (eos_token_id is not None and pad_token_id is None):
            return None
        return cls(generation_config.do_sample, processors, max_length, eos_token_id, pad_token_id)

    def run(self, model, input_ids, generation_config, streamer, model_kwargs):
        # The cache outlives generate when the caller passed it or asked for it back: it must then
        # have seen exactly the tokens transformers' loop would have fed it.
        cache_outlives = generation_config.return_dict_in_generate or any(
            model_kwargs.get(name) is not None for name in ("cache", "past_key_values"))
        outputs = model._prefill(input_ids, generation_config, model_kwargs)
        cache = getattr(outputs, CACHE_FIELD)
        device = input_ids.device
        batch_size, length = input_ids.shape
        new_tokens = max(self.max_length - length, 1)  # transformers' loop always chooses one
        steps = _Steps(self, model, cache, batch_size, length, KeptStep.capacity(model, new_tokens), device)
        kept = KeptStep.lend(model, steps, cache) if steps.use_graph and new_tokens > 1 else None
        if kept is not None:
            steps = kept.steps
        try:
            steps.choose(outputs.logits[:, -1].to(device=device))
            del outputs  # the prompt's logits
            produced = self.decode(steps, cache, new_tokens, cache_outlives, streamer)
            sequences = torch.cat([input_ids, steps.sequences[:, :produced]], dim=-1)
        finally:
            if kept is not None:
                kept.take_back(cache, cache_outlives)
        if generation_config.return_dict_in_generate:
            return GenerateDecoderOnlyOutput(sequences=sequences, **{GENERATE_CACHE_FIELD: cache})
        return sequences

    def decode(self, steps, cache, new_tokens, cache_outlives, streamer):
        """The steps after the first token, read every TOKENS_PER_SYNC steps: how many tokens count."""
        produced, finished = steps.read(0, 1, streamer)
        saved = None
        random_state = RandomState(steps.device) if self.do_sample else None
        while produced < new_tokens and not finished:
            block = min(TOKENS_PER_SYNC, new_tokens - produced)
            if cache_outlives:
                saved = cache.save_states(saved)
            if random_state is not None:
                random_state.save()
            for _ in range(block):
                steps.run()
            cache.advance(block)
            valid, finished = steps.read(produced, block, streamer)
            if valid < block and cache_outlives:
                # Every sequence ended inside the block: undo the steps past the end, then feed the
                # block's inputs again up to it (the chosen tokens stand).
                cache.restore_states(saved)
                for column in range(produced - 1, produced - 1 + valid):
                    steps.advance(steps.sequences[:, column:column + 1])
                cache.advance(valid)
            if valid < block and random_state is not None:
                # transformers' loop draws once a token: the steps past the end must not have drawn,
                # or later draws (the next sampling call's from the same seed) would differ.
                random_state.restore()
                for _ in range(valid):
                    steps.draw()
            produced += valid
        if streamer is not None:
            streamer.end()
        return produced


class _Steps:
    """The device-side state of one DeviceDecoding run and its step: the tokens chosen so far, the
    rows not yet ended, and the CUDA graph of a step."""

    def __init__(self, decoding, model, cache, batch_size, length, capacity, device):
        self.decoding, self.model, self.cache, self.device = decoding, model, cache, device
        self.sequences = torch.zeros(batch_size, capacity, dtype=torch.long, device=device)
        self.any_unfinished = torch.zeros(capacity, dtype=torch.bool, device=device)  # after each token
        self.unfinished = torch.ones(batch_size, dtype=torch.bool, device=device)
        self.token = torch.zeros(batch_size, 1, dtype=torch.long, device=device)  # the next step's input
        self.position = torch.zeros(1, dtype=torch.long, device=device)  # the next token's column
        # Whether a token's draw had no distribution (NaN probabilities), which torch.multinomial refuses.
        self.undrawable = torch.zeros(capacity, dtype=torch.bool, device=device)
        self.eos_token_id = None if decoding.eos_token_id is None else decoding.eos_token_id.to(device)
        self.pad_token_id = None if decoding.pad_token_id is None else decoding.pad_token_id.to(device)
        # A minimum-length processor as (the tokens to choose before its end-of-sequence ids may
        # come, those ids as a vocabulary mask): the sequences are `length + position` long.
        self.vocab_size = model.get_output_embeddings().weight.shape[0]  # the logits' width
        vocabulary = torch.arange(self.vocab_size, device=device)
        self.processors = [processor if not isinstance(processor, tuple)
                           else (torch.tensor(processor[0] - length, device=device),
                                 torch.isin(vocabulary, processor[1].to(device)))
                           for processor in decoding.processors]
        # The fused greedy choice takes the minimum lengths as (column, the position it is masked until).
        self.fused_choice = (FUSED_GREEDY_CHOICE and greedy_choice is not None and device.type == "cuda"
                             and not decoding.do_sample and batch_size <= GREEDY_CHOICE_MAX_ROWS
                             and all(isinstance(processor, tuple) for processor in decoding.processors))
        minimum_lengths = [(minimum, ids.to(device).flatten()) for minimum, ids in
                           (processor for processor in decoding.processors if isinstance(processor, tuple))]
        none = torch.zeros(0, dtype=torch.long, device=device)
        self.masked_ids = torch.cat([ids for _, ids in minimum_lengths] + [none])
        self.masked_until = torch.cat([torch.full_like(ids, minimum - length) for minimum, ids in minimum_lengths]
                                      + [none])
        self.graph = None
        self.use_graph = graph_can_run(model, cache, device)

    def buffers(self):
        """The tensors a step reads besides the model and the cache, None where a setting is absent."""
        minimum_lengths = [x for processor in self.processors if isinstance(processor, tuple) for x in processor]
        return [self.sequences, self.any_unfinished, self.unfinished, self.token, self.position, self.undrawable,
                self.eos_token_id, self.pad_token_id, self.masked_ids, self.masked_until, *minimum_lengths]

    def signature(self):
        """What a captured step depends on besides the model and the values of `buffers()`: the
        buffers' shapes and the settings that the step's code reads. None where a processor holds
        more than plain settings, which could change unseen."""
        settings = []
        for processor in self.processors:
            if isinstance(processor, tuple):
                settings.append("minimum length")  # its tensors are buffers
                continue
            values = tuple(sorted(vars(processor).items()))
            if not all(isinstance(value, (bool, int, float, str, type(None))) for _, value in values):
                return None
            settings.append((type(processor), values))
        return (self.decoding.do_sample, self.fused_choice, tuple(settings),
                tuple(None if x is None else (x.shape, x.dtype, x.device) for x in self.buffers()))

    def load(self, other):
        """The values of another _Steps' buffers, of the same signature, into this one's."""
        torch._foreach_copy_([x for x in self.buffers() if x is not None],
                             [x for x in other.buffers() if x is not None])

    def choose(self, logits):
        """The next token of every row from its logits [B, V] on the device, as transformers' loop
        chooses it (from the logits in fp32), written to `sequences` and to the next step's input."""
        if self.fused_choice:
            greedy_choice(logits, self.masked_ids, self.masked_until, self.eos_token_id, self.pad_token_id,
                          self.unfinished, self.sequences, self.any_unfinished, self.token, self.position)
            return
        scores = logits.to(torch.float32)
        for processor in self.processors:
            if isinstance(processor, tuple):
                min_new_tokens, eos_mask = processor
                scores = scores.masked_fill(eos_mask & (self.position < min_new_tokens), -float("inf"))
            else:
                scores = processor(self.sequences, scores)
        if self.decoding.do_sample:
            # torch.multinomial's own draw of one sample (the exponential race), without its checks,
            # which read the probabilities on the host.
            probabilities = F.softmax(scores, dim=-1)
            self.undrawable.index_copy_(0, self.position, probabilities.isnan().any()[None])
            token = (probabilities / self.draw()).argmax(-1)
        else:
            token = scores.argmax(-1)
        if self.eos_token_id is not None:
            token = torch.where(self.unfinished, token, self.pad_token_id)
            # (torch.isin sorts, and syncs, past ~10 ids: no sync may happen inside a capture.)
            self.unfinished &= ~(token[:, None] == self.eos_token_id).any(-1)
        any_unfinished = self.unfinished.any()
        self.sequences.index_copy_(1, self.position, token[:, None])
        self.any_unfinished.index_copy_(0, self.position, any_unfinished[None])
        # Once every row has ended, the steps left in the read run on tokens that are dropped: they
        # take id 0, not the padding id, which transformers' loop never embeds then and which may lie
        # outside the vocabulary (-1 in LLaMA's configs).
        self.token.copy_(torch.where(any_unfinished, token, 0)[:, None])
        self.position += 1

    def draw(self):
        """The random numbers of one step's sampling [B, V]: torch.multinomial's for one sample."""
        return torch.empty(self.unfinished.shape[0], self.vocab_size, device=self.device).exponential_(1)

    def advance(self, token):
        """The layers on `token` [B, 1]: the cache's states move on; returns the last hidden state."""
        base = self.model.model
        return base.run_layers(embed(base.embed_tokens, token), None, None, self.cache, None, False)[0]

    def step(self):
        hidden_states = self.advance(self.token)
        self.choose(self.model.lm_head(hidden_states[:, -1:])[:, -1].to(device=self.device))

    def run(self):
        """One step: from the graph once captured (its capture's warm-up is the first step)."""
        if not self.use_graph:
            self.step()
        elif self.graph is None:
            self.graph = ResLinDecodeGraph.capture(self.model, self.step)[1]
        else:
            self.graph.replay()

    def read(self, start, count, streamer):
        """The host's read of tokens start .. start + count: (how many of them count, whether every
        row has ended). Tokens after the step at which the last row ended are dropped."""
        ended = (~self.any_unfinished[start:start + count]).nonzero()
        valid = int(ended[0]) + 1 if len(ended) else count
        undrawable = self.undrawable[start:start + valid].nonzero()
        if len(undrawable):
            # torch.multinomial's own words, as transformers' loop fails with them.
            raise RuntimeError(f"probability tensor contains either `inf`, `nan` or element < 0 (new token "
                               f"{start + int(undrawable[0]) + 1}: NaN logits, or every token's score is -inf)")
        if streamer is not None:
            tokens = self.sequences[:, start:start + valid].cpu()
            for i in range(valid):
                streamer.put(tokens[:, i].clone())
        return valid, len(ended) > 0


# model -> its KeptStep; the lock guards the taking and giving back of one.
_KEPT_STEPS = weakref.WeakKeyDictionary()
_KEPT_STEPS_LOCK = threading.Lock()


class KeptStep:
    """A generation step's CUDA graph kept between a model's generate calls: the _Steps whose
    buffers the graph reads, and the cache states and side-by-side weights it was captured
    against. A call of the same settings, on the same weights (the same tensors, unmodified since:
    their versions), loads its values into the buffers and its cache's states into the kept ones,
    and lends the cache the kept states for its length (`lend`, `take_back`): the graph, its
    steps and its states stay where they were. One call at a time holds it; another call meanwhile
    runs on a graph of its own, as every call did before."""

    def __init__(self, key, steps, cache):
        self.key, self.steps = key, steps
        self.states = ([tuple(x.clone() for x in layer) for layer in cache.conv_states],
                       [tuple(None if x is None else x.clone() for x in layer) for layer in cache.recurrent_states],
                       dict(cache.side_by_side), {})
        self.cache_states = None  # the borrowing cache's own, while lent
        self.in_use = False

    @staticmethod
    def capacity(model, new_tokens):
        """The new tokens a call's buffers hold: enough for this call, and as many as the kept step's."""
        kept = _KEPT_STEPS.get(model)
        return max(KEPT_MIN_TOKENS, 1 << (new_tokens - 1).bit_length(),
                   0 if kept is None else kept.steps.sequences.shape[1])

    @staticmethod
    def key(model, steps):
        signature = steps.signature()
        if signature is None:
            return None
        weights = tuple((*tensor_identity(x), x.dtype, x.shape)
                        for x in itertools.chain(model.parameters(), model.buffers()))
        # Tensors made under inference_mode (the kept states, when it was on) may be written only under it.
        return (signature, weights, getattr(triton_launch, "PROGRAMMATIC_LAUNCH_MAX_ROWS", None),
                getattr(triton_gemv, "SPLIT_K_MAX_ROWS", None), torch.is_inference_mode_enabled())

    @classmethod
    def lend(cls, model, steps, cache):
        """The model's kept step, loaded with `steps`' values and lent `cache`'s states, or a new one
        that `steps` becomes (its graph captured at its first step); None where this call's settings
        cannot be kept or another call holds the model's."""
        key = cls.key(model, steps)
        if key is None:
            return None
        with _KEPT_STEPS_LOCK:
            kept = _KEPT_STEPS.get(model)
            if kept is not None and kept.in_use:
                return None
            reused = kept is not None and kept.key == key
            if not reused:
                _KEPT_STEPS.pop(model, None)  # its graph and states freed before this call captures
                kept = _KEPT_STEPS[model] = cls(key, steps, cache)
            kept.in_use = True
        if reused:
            kept.steps.load(steps)
        kept.steps.model, kept.steps.cache = model, cache
        kept.cache_states = cache.swap_step_states(kept.states)
        if reused:
            torch._foreach_copy_(_state_tensors(kept.states), _state_tensors(kept.cache_states))
        return kept

    def take_back(self, cache, cache_outlives):
        """The cache's own states back, with the call's values where the cache outlives the call."""
        self.states = cache.swap_step_states(self.cache_states)
        if cache_outlives:
            torch._foreach_copy_(_state_tensors(self.cache_states), _state_tensors(self.states))
        self.cache_states = self.steps.model = self.steps.cache = None  # the model must not be kept alive
        with _KEPT_STEPS_LOCK:
            self.in_use = False


def release_kept_step(model):
    """Free the model's kept step graph and states (the next call captures again)."""
    with _KEPT_STEPS_LOCK:
        _KEPT_STEPS.pop(model, None)


def _state_tensors(states):
    """The tensors of (conv_states, recurrent_states, side_by_side, split counters) that hold
    values between steps, in one order (the counters are zero between launches)."""
    conv_states, recurrent_states, *_ = states
    return [x for layer in (*conv_states, *recurrent_states) for x in layer if x is not None]
