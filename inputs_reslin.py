"""The checks of what a caller passes to a ResLin model: token ids, embeddings, positions, caches,
masks, labels and prompts. Each error names the argument and the problem, where the unchecked
input would fail deep inside torch or a kernel, or give silent garbage. A generation step's
checks read no tensor values on the host: a device sync at every token costs more than the step.
"""

import torch


def check_token_values(name, tokens, vocab_size, ignore_index=None):
    """Every value in [0, vocab_size), or equal to `ignore_index` (labels), read in one device sync:
    out of range, the embedding lookup or the loss's gather fails inside torch (on CUDA a
    device-side assertion that leaves the process's CUDA context unusable)."""
    valid = (tokens >= 0) & (tokens < vocab_size)
    if ignore_index is not None:
        valid = valid | (tokens == ignore_index)
    allowed = f"[0, vocab_size={vocab_size})" + (f" or be {ignore_index} (ignored)" if ignore_index is not None else "")
    if torch.compiler.is_compiling():
        # Reading the values on the host would break torch.compile's graph: the device checks them.
        torch._assert_async(valid.all(), f"{name} must lie in {allowed}")
        return
    if not bool(valid.all()):
        raise ValueError(f"{name} must lie in {allowed}, got {tokens[~valid][:8].tolist()} among them")


def check_integer_tensor(name, value):
    """A 2-D tensor of integers (token ids, labels, positions), by type, dtype and rank only."""
    if not torch.is_tensor(value):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name} must hold integers as torch.long (or torch.int32), got dtype {value.dtype}")
    if value.dim() != 2:
        raise ValueError(f"{name} must have shape [batch, tokens], got {tuple(value.shape)}")


def check_model_inputs(config, input_ids, inputs_embeds, position_ids, cache, embedding_dtype=None):
    """Check what a caller passed to the model's forward, from types, dtypes and shapes only: no
    value is read, so no device sync, and it runs at every generation step. Returns the batch
    size and the number of new tokens. (The attention mask is checked by check_attention_mask,
    which needs the cache's length.) `embedding_dtype`: the model's, which inputs_embeds must
    have outside autocast."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("Pass exactly one of input_ids and inputs_embeds" +
                         (", not both" if input_ids is not None else ", got neither"))
    if input_ids is not None:
        check_integer_tensor("input_ids", input_ids)
        name, shape = "input_ids", input_ids.shape
    else:
        if not torch.is_tensor(inputs_embeds):
            raise TypeError(f"inputs_embeds must be a torch.Tensor, got {type(inputs_embeds).__name__}")
        if not inputs_embeds.is_floating_point():
            raise TypeError(f"inputs_embeds must be floating point, got dtype {inputs_embeds.dtype}")
        if inputs_embeds.dim() != 3 or inputs_embeds.shape[2] != config.hidden_size:
            raise ValueError(f"inputs_embeds must have shape [batch, tokens, hidden_size={config.hidden_size}], "
                             f"got {tuple(inputs_embeds.shape)}")
        if (embedding_dtype is not None and inputs_embeds.dtype != embedding_dtype
                and not torch.is_autocast_enabled(inputs_embeds.device.type)):
            raise TypeError(f"inputs_embeds have dtype {inputs_embeds.dtype}, the model {embedding_dtype}: "
                            f"pass inputs_embeds.to({embedding_dtype}), or run under torch.autocast")
        name, shape = "inputs_embeds", inputs_embeds.shape
    batch_size, num_tokens = shape[:2]
    if batch_size == 0 or num_tokens == 0:
        raise ValueError(f"{name} is empty (shape {tuple(shape)}): give at least one row of at least one token")
    if position_ids is not None:
        check_integer_tensor("position_ids", position_ids)
        if position_ids.shape[0] not in (1, batch_size) or position_ids.shape[1] != num_tokens:
            raise ValueError(f"position_ids must have shape [batch, tokens] = [{batch_size}, {num_tokens}] "
                             f"(or [1, {num_tokens}]), got {tuple(position_ids.shape)}")
    # By what it can do rather than its class: a ResLinCache imported through another path
    # (remote code, the repository's own folder) is another class object.
    if cache is not None and not callable(getattr(cache, "check_compatible", None)):
        raise TypeError(f"cache must be a ResLinCache, got {type(cache).__name__}: ResLin layers keep recurrent "
                        f"states that transformers' caches cannot hold (pass None and the model builds its own; "
                        f"PEFT's prefix tuning, which passes prefix keys and values, does not apply to them)")
    if cache is not None:
        cache.check_compatible(config, batch_size)
    return batch_size, num_tokens


def check_prompt(config, input_ids, inputs_embeds, attention_mask):
    """What generate was given as the prompt: input_ids and/or inputs_embeds (both: the ids are
    returned as the prompt of the embeddings, so their shapes agree), and the mask over it."""
    if inputs_embeds is not None:
        prompt_shape = check_model_inputs(config, None, inputs_embeds, None, None)
        if input_ids is not None:
            check_integer_tensor("input_ids", input_ids)
            if tuple(input_ids.shape) != prompt_shape:
                raise ValueError(f"input_ids given with inputs_embeds must have their [batch, tokens] = "
                                 f"{list(prompt_shape)}, got {tuple(input_ids.shape)}")
    elif input_ids is not None:
        prompt_shape = check_model_inputs(config, input_ids, None, None, None)
    else:
        return  # generate starts from the bos token, or says that there is none
    if attention_mask is not None:
        check_attention_mask(attention_mask, *prompt_shape, check_values=False)


def check_labels(name, labels, input_shape, num_logits, vocab_size, ignore_index):
    """`labels` (or `shift_labels`) against the inputs' [batch, tokens], the logits kept and the
    vocabulary (one device sync)."""
    check_integer_tensor(name, labels)
    if tuple(labels.shape) != input_shape:
        raise ValueError(f"{name} must have the inputs' shape [batch, tokens] = {list(input_shape)}, "
                         f"got {tuple(labels.shape)}")
    if num_logits != input_shape[1]:
        raise ValueError(f"{name} need the logits of every position: pass logits_to_keep=0 (it keeps {num_logits} "
                         f"of {input_shape[1]})")
    check_token_values(name, labels, vocab_size, ignore_index)


def check_logits_to_keep(logits_to_keep, num_tokens):
    """An int >= 0 (that many last positions, 0: all) or a 1-D integer tensor of positions."""
    if isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, (int, torch.Tensor)):
        raise TypeError(f"logits_to_keep must be an int or a tensor of positions, got {type(logits_to_keep).__name__}")
    if isinstance(logits_to_keep, int) and logits_to_keep < 0:
        raise ValueError(f"logits_to_keep must be >= 0 (the last positions kept, 0: all {num_tokens}), "
                         f"got {logits_to_keep}")
    if torch.is_tensor(logits_to_keep) and (logits_to_keep.dim() != 1
                                            or logits_to_keep.dtype not in (torch.int64, torch.int32)):
        raise ValueError(f"logits_to_keep as a tensor must be 1-D integer positions, got shape "
                         f"{tuple(logits_to_keep.shape)} and dtype {logits_to_keep.dtype}")


def check_attention_mask(attention_mask, batch_size, total_length, check_values=True):
    """Validate a 2-D padding mask; return it as bool, or None when nothing is padded. Without
    `check_values` only its shape is checked, and it is returned as bool: reading its values
    costs a device sync."""
    if not torch.is_tensor(attention_mask):
        raise TypeError(f"attention_mask must be a torch.Tensor, got {type(attention_mask).__name__}")
    if attention_mask.is_complex():
        raise TypeError(f"attention_mask must hold 0 (padding) and 1 (token) as integers, booleans or floats, "
                        f"got dtype {attention_mask.dtype}")
    if attention_mask.dim() != 2 or tuple(attention_mask.shape) != (batch_size, total_length):
        raise ValueError(f"attention_mask must have shape [batch, past + new tokens] = [{batch_size}, {total_length}], "
                         f"got {tuple(attention_mask.shape)}")
    mask = attention_mask != 0
    if not check_values:
        return mask
    runs_of_ones = mask[:, :1].sum(-1) + (mask[:, 1:] & ~mask[:, :-1]).sum(-1)
    # One device sync for all three checks.
    binary, contiguous, unpadded = torch.stack(
        [((attention_mask == 0) | (attention_mask == 1)).all(), (runs_of_ones <= 1).all(), mask.all()]).tolist()
    if not binary:
        raise ValueError("attention_mask must contain only 0 (padding) and 1 (token)")
    if not contiguous:
        raise ValueError("attention_mask has padding between tokens: each row's ones must be contiguous "
                         "(left or right padding only). generate, given no attention_mask, makes one from "
                         "pad_token_id: a prompt with that token inside it needs its own attention_mask")
    return None if unpadded else mask
