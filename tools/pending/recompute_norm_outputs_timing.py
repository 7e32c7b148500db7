"""Timing of tools/pending/recompute-norm-outputs.patch (apply it first): the norms' outputs
recomputed against kept (RecomputedOutputs off), the 400M model at B4xT4096 as bench_training.py
runs it: the gradients of one step compared bit for bit, then step time, the step's GPU kernel
time (profiled: whether the GPU's time or the host's grew) and peak memory, the two alternating,
in one process. On the GPU machine:

    python tools/pending/recompute_norm_outputs_timing.py gdn rdn
"""
import sys, contextlib
sys.path.insert(0, "benchmarks"); sys.path.insert(0, ".")  # run from the repository root
import torch
from bench_generate import SHAPE, load_ours
from bench_training import measure

ids = torch.randint(0, SHAPE["vocab_size"], (4, 4096), device="cuda")
for rule in sys.argv[1:] or ["gdn", "rdn"]:
    torch.manual_seed(0)
    model = load_ours(rule, SHAPE, "auto")
    block_class = type(model.model.layers[0])
    recomputing = block_class.recomputed_outputs
    keeping = lambda self, x: contextlib.nullcontext()

    def grads():
        model.zero_grad(set_to_none=True)
        model.train()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    block_class.recomputed_outputs = recomputing
    loss_r, g_r = grads()
    block_class.recomputed_outputs = keeping
    loss_k, g_k = grads()
    same = torch.equal(loss_r, loss_k) and all(torch.equal(a, b) for a, b in zip(g_r, g_k))
    print(f"{rule}: loss {loss_r.item():.6f} / {loss_k.item():.6f}, every gradient bit-identical: {same}", flush=True)
    del g_r, g_k
    model.zero_grad(set_to_none=True)
    for round in range(2):
        for name, method in (("kept", keeping), ("recomputed", recomputing)):
            block_class.recomputed_outputs = method
            torch.cuda.empty_cache()
            ms, peak, loss, kernels = measure(model, ids, 10, 2, False, profile=True)
            print(f"{rule} {name:10s} round {round}: step {ms:.1f} ms, {4 * 4096 / ms * 1e3:,.0f} tok/s, "
                  f"GPU kernels {sum(kernels.values()) / 1e3:.1f} ms, peak {peak:.2f} GiB", flush=True)
    block_class.recomputed_outputs = recomputing
    del model
    torch.cuda.empty_cache()
