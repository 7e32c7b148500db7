"""Context parallelism: one long sequence split across the ranks of a process group.

Rank r of P holds tokens [start_r, end_r) of every row (`shard_bounds`: torch.tensor_split's
split, the first T % P ranks taking one token more) and runs the whole model on them, each
linear attention layer starting from the states that same layer reached at the end of rank
r - 1's tokens. Those states have a fixed size whatever T: per layer the recurrent states S (and
R for the residual rules), fp32 [B, HV, Dk, Dv], and the short convolutions' last conv_size - 1
inputs. Only they travel, point to point, as one fp32 message per layer:

    forward   rank r - 1, layer l: final states        -->  rank r, layer l: initial states
    backward  rank r, layer l: their gradient          -->  rank r - 1, layer l: its final states' gradient

Each layer waits only for the same layer of the neighbouring rank, so the ranks form a pipeline
across the layers: in the forward rank r runs layer l while rank r + 1 runs layer l - 1, and the
backward runs the other way round, led by the last rank. With L layers a forward takes about
L + P - 1 layer-times of T / P tokens, against L layer-times of T tokens on one device.

The model itself is unchanged: during a `context_parallel_forward` call, hooks on each linear
attention module put the received states into the ResLinCache the model runs with (where a
generation step finds its states) and send what the layer left there. The send is an identity on
the layer's output in the autograd graph, so the gradient of the sent states is received exactly
when the backward reaches that layer's output.

Softmax attention layers (hybrid stacks) are refused: their queries need the keys and values of
every earlier rank, which this does not exchange. Gradient checkpointing is refused too: a
checkpointed layer runs without the cache, and its recomputation would exchange states again.

Every rank calls `context_parallel_forward` with the same whole batch (token ids are small) and,
when training, backward on its own loss; the losses add up to the single-process loss and the
parameter gradients to its gradients, which `all_reduce_gradients` sums over the group. Launched
with torchrun:

    # torchrun --nproc-per-node 2 train_long.py
    import os
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    repo = "path/or/hub-id-of-a-reslin-model"
    model = AutoModelForCausalLM.from_pretrained(repo, trust_remote_code=True).cuda()
    parallel = "context_parallel_reslin.{}"
    context_parallel_forward = get_class_from_dynamic_module(parallel.format("context_parallel_forward"), repo)
    all_reduce_gradients = get_class_from_dynamic_module(parallel.format("all_reduce_gradients"), repo)

    input_ids = ...  # [B, 65536], the same on every rank
    with torch.autocast("cuda", dtype=torch.bfloat16):
        output = context_parallel_forward(model, input_ids, labels=input_ids)
    output.loss.backward()  # this rank's share of the loss
    all_reduce_gradients(model)  # now every rank holds the whole batch's gradients
    optimizer.step()

From a clone of the repository `from context_parallel_reslin import context_parallel_forward`
works too, with a model from any of its copies.
"""

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

# Relative imports for the remote-code loader; plain ones for `from context_parallel_reslin import ...`.
try:
    from .cache_reslin import ResLinCache
except ImportError:
    from cache_reslin import ResLinCache

IGNORE_INDEX = -100  # the label transformers' causal LM loss skips


def shard_bounds(length, rank, world_size):
    """[start, end) of the tokens `rank` holds: torch.tensor_split's split of `length` tokens."""
    base, extra = divmod(length, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def context_parallel_forward(model, input_ids, labels=None, attention_mask=None, group=None):
    """Run `model` over `input_ids` [B, T] with the sequence split across `group` (default: the
    whole world); every rank passes the same whole batch and gets the output of its own tokens.

    Args:
        model: a ResLinForCausalLM or ResLinModel whose layers are all linear attention, or a
            wrapper that passes keyword arguments through to one (a PEFT model, say).
        labels: [B, T] as for ResLinForCausalLM (next-token targets, shifted here, -100 ignored).
            This rank's loss is the sum of its tokens' cross-entropies divided by the number of
            targets in the whole batch, so that the ranks' losses add up to the single-process loss.
        attention_mask: [B, T] padding mask of the whole batch (0 = padding), or None.

    Returns:
        The model's output for tokens [start, end) = shard_bounds(T, rank, P): logits (or
        last_hidden_state), this rank's loss, and the cache holding the layers' states after
        token end - 1; on the last rank that is the state after the whole sequence, from which
        generation continues as after a single-process prefill.
    """
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    reslin = find_reslin_model(model)
    refuse_unsupported(reslin)
    batch_size, length = input_ids.shape
    if length < world_size:
        raise ValueError(f"context parallelism over {world_size} ranks needs at least one token per rank, "
                         f"got a sequence of {length}")
    start, end = shard_bounds(length, rank, world_size)
    inputs = dict(input_ids=input_ids[:, start:end],
                  position_ids=torch.arange(start, end, device=input_ids.device).expand(batch_size, -1))
    if attention_mask is not None:
        inputs["attention_mask"] = attention_mask[:, start:end]
    if labels is not None:
        if labels.shape != input_ids.shape:
            raise ValueError(f"labels must be shaped like input_ids {tuple(input_ids.shape)}, "
                             f"got {tuple(labels.shape)}")
        # The target of this rank's last token is the next rank's first label: shifted here, and handed to the
        # model's own loss as transformers' `shift_labels`, with the whole batch's count of targets as divisor.
        targets = F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, start + 1:end + 1].contiguous()
        inputs.update(labels=targets, shift_labels=targets, num_items_in_batch=(labels[:, 1:] != IGNORE_INDEX).sum())

    cache = ResLinCache(reslin.config, batch_size)
    handover = StateHandover(cache, group, rank, world_size)
    hooks = handover.attach(reslin)
    try:
        output = model(**inputs, cache=cache, return_dict=True)
    finally:
        for hook in hooks:
            hook.remove()
    handover.wait_for_sends()
    if labels is not None and getattr(output, "loss", None) is None:
        raise ValueError("labels need a model with a language-model head: pass a ResLinForCausalLM, not a ResLinModel")
    cache.advance(start)  # count the tokens of the earlier ranks too, as a single-process prefill would
    return output


def all_reduce_gradients(model, group=None):
    """Sum every parameter's gradient over `group`: after each rank's backward of its
    context_parallel_forward loss, the sums are the single-process gradients."""
    works = [dist.all_reduce(p.grad, group=group, async_op=True) for p in model.parameters() if p.grad is not None]
    for work in works:
        work.wait()


def find_reslin_model(model):
    """The ResLinModel in `model`: itself, or inside a ResLinForCausalLM or a wrapper. Found by
    its config's model_type, since a model loaded through remote code has its own copy of the classes."""
    for module in model.modules():
        if getattr(getattr(module, "config", None), "model_type", None) == "reslin" and hasattr(module, "layers"):
            return module
    raise ValueError(f"context parallelism takes a ResLin model (ResLinForCausalLM or ResLinModel), "
                     f"got {type(model).__name__}")


def refuse_unsupported(reslin):
    softmax_layers = [i for i, kind in enumerate(reslin.config.layer_types) if kind != "linear_attention"]
    if softmax_layers:
        raise ValueError(f"context parallelism runs linear attention layers only, but layers {softmax_layers} are "
                         "softmax attention, whose queries need the keys and values of every earlier rank (not "
                         "exchanged here): run this hybrid model on one device")
    if torch.is_grad_enabled() and any(layer.gradient_checkpointing and layer.training for layer in reslin.layers):
        raise ValueError("context parallelism does not work with gradient checkpointing: a checkpointed layer runs "
                         "without the cache that carries the states between ranks; turn checkpointing off")


def state_shapes(layer, batch_size):
    """Shapes of a linear attention layer's states, in the order they travel: the q, k and v
    convolutions' last inputs, then S (and R)."""
    convs = (layer.q_conv1d, layer.k_conv1d, layer.v_conv1d)
    recurrent = (batch_size, layer.num_v_heads, layer.head_dim, layer.head_v_dim)
    return ([(batch_size, conv.weight.shape[0], conv.kernel_size[0] - 1) for conv in convs]
            + [recurrent] * (2 if layer.use_residual else 1))


class StateHandover:
    """Moves each layer's states from rank r - 1 to rank r during one forward (and their gradients
    back during its backward), through hooks on the layers' linear attention modules."""

    def __init__(self, cache, group, rank, world_size):
        self.cache = cache
        self.group = group
        self.previous = rank - 1 if rank > 0 else None
        self.next = rank + 1 if rank < world_size - 1 else None
        self.sends = []  # (work, tensor) of the forward's sends: the tensors must outlive the sends

    def attach(self, reslin):
        hooks = []
        for block in reslin.layers:
            if self.previous is not None:
                hooks.append(block.attn.register_forward_pre_hook(self.receive))
            if self.next is not None:
                hooks.append(block.attn.register_forward_hook(self.send))
        return hooks

    def receive(self, layer, args):
        """Before layer l runs: its initial states from rank r - 1, into the cache."""
        x = args[0]
        shapes = state_shapes(layer, x.shape[0])
        sizes = [math.prod(shape) for shape in shapes]
        # Autograd calls a Function's backward only if one of its inputs requires grad: the received
        # states have no input of their own, so they hang from this empty one.
        anchor = torch.empty(0, device=x.device, requires_grad=True)
        flat = ReceiveStates.apply(anchor, sum(sizes), self.previous, self.group)
        states = [part.view(shape) for part, shape in zip(flat.split(sizes), shapes)]
        # fp32 whatever the model's dtype: the convolutions cast their state to their input's dtype.
        self.cache.conv_states[layer.layer_idx] = tuple(states[:3])
        self.cache.recurrent_states[layer.layer_idx] = (states[3], states[4] if layer.use_residual else None)

    def send(self, layer, args, output):
        """After layer l ran: the final states it left in the cache, to rank r + 1."""
        conv_states = self.cache.conv_states[layer.layer_idx]
        recurrent_states = self.cache.recurrent_states[layer.layer_idx]
        flat = torch.cat([x.float().flatten() for x in (*conv_states, *recurrent_states) if x is not None])
        self.sends.append((dist.isend(flat.detach(), group=self.group, group_dst=self.next), flat))
        return SendStates.apply(output, flat, self.next, self.group)

    def wait_for_sends(self):
        for work, _ in self.sends:
            work.wait()
        self.sends.clear()


class ReceiveStates(torch.autograd.Function):
    """A layer's initial states from the previous rank, flat fp32; backward sends their gradient back."""

    @staticmethod
    def forward(ctx, anchor, numel, previous, group):
        ctx.previous, ctx.group = previous, group
        states = anchor.new_empty(numel, dtype=torch.float32)
        dist.recv(states, group=group, group_src=previous)
        return states

    @staticmethod
    def backward(ctx, grad_states):
        dist.send(grad_states.contiguous(), group=ctx.group, group_dst=ctx.previous)
        return None, None, None, None


class SendStates(torch.autograd.Function):
    """Identity on a layer's output, standing for the final states sent to the next rank (sent by
    StateHandover.send): its backward, reached with the gradient of that output, receives their
    gradient from the next rank."""

    @staticmethod
    def forward(ctx, output, states, next_rank, group):
        ctx.numel, ctx.next_rank, ctx.group = states.numel(), next_rank, group
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output):
        grad_states = grad_output.new_empty(ctx.numel, dtype=torch.float32)
        dist.recv(grad_states, group=ctx.group, group_src=ctx.next_rank)
        return grad_output, grad_states, None, None


__all__ = ["context_parallel_forward", "all_reduce_gradients", "shard_bounds"]
