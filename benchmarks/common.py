"""What the benchmarks share: the rules' inputs as the model builds them, timing, the header.

Importing this module puts the repository root on sys.path (so `from kernels_reslin import ...`
works) and, without a GPU, sets TRITON_INTERPRET=1 before Triton is imported, so that the
`--smoke` runs exercise our Triton kernels in Triton's CPU interpreter. The interpreter computes
bf16 wrongly without an error, hence DTYPE is fp32 there.
"""

import contextlib
import itertools
import os
import statistics
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

RULES = {  # name: (update, residual, kaczmarz)
    "sgla": ("additive", False, False), "gdn": ("delta", False, False), "kla": ("delta", False, True),
    "rla": ("additive", True, False), "rdn": ("delta", True, False), "rkla": ("delta", True, True),
}
KACZMARZ_EPS = 1e-6  # ResLinConfig.kaczmarz_eps's default


def rule_inputs(rule, B, T, H, D, device=DEVICE, dtype=DTYPE):
    """Keyword arguments of reslin_attention / reslin_decode_step for `rule`, shaped and scaled
    as ResLinLinearAttention builds them: q always L2-normalised; k L2-normalised except for the
    Kaczmarz rules, whose raw keys take beta = eta / (||k||^2 + eps) and, for RKLA, the residual
    write gamma_write = gamma / (||k||^2 + eps); g <= 0, beta, eta and gamma in [0, 1] in fp32."""
    update, residual, kaczmarz = RULES[rule]
    q = torch.nn.functional.normalize(torch.randn(B, T, H, D, device=device, dtype=dtype), dim=-1)
    k = torch.randn(B, T, H, D, device=device, dtype=dtype)
    beta = torch.rand(B, T, H, device=device)
    gamma = torch.rand(B, T, H, device=device) if residual else None
    gamma_write = None
    if kaczmarz:
        key_norm2 = k.float().pow(2).sum(-1) + KACZMARZ_EPS
        beta = beta / key_norm2
        gamma_write = gamma / key_norm2 if residual else None
    else:
        k = torch.nn.functional.normalize(k, dim=-1)
    return dict(q=q, k=k, v=torch.randn(B, T, H, D, device=device, dtype=dtype),
                g=-torch.rand(B, T, H, device=device), beta=beta, gamma=gamma, gamma_write=gamma_write,
                update=update)


def import_fla():
    """The `fla` package, or None: on a CPU (its kernels would only run interpreted, far too slowly
    to compare with) or where it is not installed."""
    if DEVICE != "cuda":
        return None
    try:
        import fla
        import fla.ops.gated_delta_rule  # noqa: F401
        import fla.ops.simple_gla  # noqa: F401
    except ImportError:
        return None
    return fla


def fla_autotuners():
    """The Triton autotuners of FLA's imported kernels, those under `triton.heuristics` included."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import KernelInterface

    tuners = {}
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "fla" or name.startswith("fla.")):
            continue
        for kernel in vars(module).values():
            while isinstance(kernel, KernelInterface) and not isinstance(kernel, Autotuner):
                kernel = getattr(kernel, "fn", None)  # a Heuristics' kernel, down to the autotuner
            if isinstance(kernel, Autotuner):
                tuners[id(kernel)] = kernel
    return list(tuners.values())


def retune_fla():
    """Make FLA's next calls tune their kernels again: every autotuner forgets its picks and
    keeps them off the disk. FLA's autotuners time their configs once a process and shape, keep
    the fastest, and by default have Triton store it on disk, where a later process on the same
    machine reads it back. Whether that pick is why FLA's times move between runs is what this
    lets a benchmark measure: its B1 x T32768 forward took 0.53 to 0.73 ms (simple GLA) and 1.27
    to 1.45 ms (delta rule) in runs a day apart on the H200, while each run's range stayed
    within 5% and ours within 2%."""
    for tuner in fla_autotuners():
        tuner.cache.clear()
        tuner.cache_results = False


def fla_picks():
    """{FLA kernel name: its autotuner's picks, one per tuned shape}: what this process's tuning
    chose (see retune_fla), printed beside FLA's times so that runs can be compared."""
    picks = {}
    for tuner in fla_autotuners():
        for config in tuner.cache.values():
            settings = ", ".join(f"{key}={value}" for key, value in config.all_kwargs().items())
            picks.setdefault(tuner.base_fn.__name__, []).append(settings)
    return picks


def print_header(what):
    """One line naming the device and the versions, so that results are read with their setting."""
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    fla = import_fla()
    if fla is not None:
        fla_text = f"FLA {fla.__version__}"
    elif DEVICE == "cpu":
        fla_text = "FLA skipped on the CPU: ours only"
    else:
        fla_text = "FLA not importable: ours only"
    device = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU (Triton interpreter, fp32)"
    print(f"{what}\n{device}, torch {torch.__version__}, triton {triton_version}, {fla_text}")


def synchronize():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def graph_replay(fn):
    """`fn` captured once in a CUDA graph; the returned callable replays it. Its warm-up calls
    (compilation, autotuning: neither may run inside a capture) run before, on the capture's
    side stream."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def median_ms(fn, repeats=10, warmup=2):
    """Median time of one call in ms after `warmup` calls (the first compile and autotune). On a
    GPU each call is timed by CUDA events, queued back to back, so the host's time is hidden
    wherever the GPU is the slower side; on the CPU by the wall clock."""
    for _ in range(warmup):
        fn()
    synchronize()
    if DEVICE != "cuda":
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - start))
        return statistics.median(times)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def us_per_call(call, calls_per_graph, repeats):
    """Microseconds a call as a generation step's CUDA graph sees it: on a GPU `calls_per_graph`
    calls captured in one graph, the replay timed (median_ms) and divided by the calls, so that
    launch gaps count and the host's time does not; on the CPU the call itself, by the wall clock."""
    if DEVICE != "cuda":
        return 1e3 * median_ms(call, repeats=repeats)

    def calls():
        for _ in range(calls_per_graph):
            call()

    return 1e3 * median_ms(graph_replay(calls), repeats=repeats) / calls_per_graph


L2_BYTES = 50 * 2**20  # an H100's or an H200's L2 cache


def copies_past_l2(make, nbytes):
    """(next, count): `next()` returns the next of `count` copies made by `make()`, each of `nbytes`
    bytes, in a cycle that passes the L2 cache twice (one copy on the CPU). A model's step reads each
    layer's weights and state once, with the other layers' reads in between: a benchmark that read
    one copy again and again would time the L2 cache, not the memory. A graph of calls must take
    at least `count` of them, so that each replay reads every copy."""
    copies = [make() for _ in range(-(-2 * L2_BYTES // nbytes) if DEVICE == "cuda" else 1)]
    return itertools.cycle(copies).__next__, len(copies)


@contextlib.contextmanager
def module_setting(module, name, value):
    """Within the block, `module.name` is `value`; the module's own value back after."""
    default = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, default)


def programmatic_launch(launch_module, on=True):
    """Within the block, `launch_module` (a kernels_reslin_triton_launch, the plain import or a
    model's remote-code copy) launches the step's kernels with programmatic dependent launch at
    every batch size if `on`, at none if not."""
    return module_setting(launch_module, "PROGRAMMATIC_LAUNCH_MAX_ROWS", 2**62 if on else 0)


def split_k(gemv_module, on=True):
    """Within the block, the products of `gemv_module` (a kernels_reslin_triton_gemv, the plain
    import or a model's remote-code copy) split K where their tiles are few, given split counters,
    at every row count of their tl.dot path if `on`, at none if not (`gemv_launch`)."""
    return module_setting(gemv_module, "SPLIT_K_MAX_ROWS", 2**62 if on else 0)


def host_ms(fn, repeats=10):
    """The host's time to issue one call in ms (Python, dispatch, launches): `repeats` calls
    queued without waiting for the GPU, by the wall clock. Where it comes near median_ms's figure
    the call is bound by the host, and only a lighter host side makes it faster."""
    fn()
    synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    elapsed = time.perf_counter() - start
    synchronize()
    return 1e3 * elapsed / repeats


def lift_fla_backward_guard():
    """Let FLA 0.6.0 run its gated backward where it refuses to, for timing it.

    FLA raises in chunk_bwd_dqkwg (fla/ops/common/chunk_o.py; every gated chunked backward:
    gated delta rule, simple GLA) on Hopper with triton >= 3.4 and < 3.7.1, whose compiler gives
    that kernel wrong values (FLA issue 640). The guard reads the module-level flag
    TRITON_ABOVE_3_7_1 at each call, so setting it lets the kernel run: its time is real, its
    values are not. Returns the note to print beside the results, or None where the guard would
    not have fired (another GPU, a newer triton, or an FLA without this flag)."""
    import fla.ops.common.chunk_o as chunk_o

    fires = (getattr(chunk_o, "IS_NVIDIA_HOPPER", False) and getattr(chunk_o, "TRITON_ABOVE_3_4_0", False)
             and getattr(chunk_o, "TRITON_ABOVE_3_7_1", True) is False)
    if not fires:
        return None
    chunk_o.TRITON_ABOVE_3_7_1 = True
    return ("note: FLA refuses its own gated backward on Hopper with triton < 3.7.1 (wrong values, FLA issue 640); "
            "its guard is lifted here for timing: FLA's backward values are wrong on this machine, its times are not")
