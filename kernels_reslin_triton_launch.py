"""Launching Triton kernels: the host-side helpers every Triton module of ResLin shares.

`_Launcher` wraps each @triton.jit kernel so that repeated launches skip Triton's per-launch
argument analysis; `_on_inputs_device` runs a launcher on its inputs' GPU; `_cdiv` and
`_next_power_of_2` are the host's tile arithmetic; `programmatic_launch` and
`_wait_for_previous_kernel` overlap the dependent kernels of a generation step. The other kernels_reslin_triton_* modules
take `triton` and `tl` from here, so that the reason for the guarded import is written once.
"""

import functools

# Inside a try block: the Hub's remote-code loader checks every import outside one and refuses to
# load the model when the package is missing. Without Triton the ImportError reaches
# kernels_reslin and modeling_reslin, which then run the PyTorch code.
try:
    import triton
    import triton.language as tl
except ImportError:
    raise

import torch

# Host-side sizes in plain Python: triton.cdiv and triton.next_power_of_2 are constexpr functions
# in triton 3.6, whose calls cost microseconds each, on every launch.
def _cdiv(a, b):
    return -(-a // b)


def _next_power_of_2(n):
    return 1 << (n - 1).bit_length()


# The releases whose binaries `_binary_launch` knows how to call. Both pass a kernel every
# parameter, constexprs included (earlier releases passed the others alone).
BYPASSED_RELEASES = ("3.6.", "3.7.")


class _Launcher:
    """A @triton.jit kernel launched as Triton launches it, `kernel[grid](*args, **kwargs)`, but on
    CUDA a specialisation's later launches go straight to the C launcher of the binary its first
    launch returned (`_binary_launch`).

    Why: Triton derives every argument's specialisation again at each launch (type, pointers'
    16-byte alignment, integers equal to 1 or multiples of 16), reads its settings and looks the
    binary up, tens of microseconds a launch for a kernel of 35 arguments; a training call makes
    7-20 launches, and calls bound by the host wait for them.

    The key here is finer than Triton's: every integer, bool and constexpr by value, pointers by
    dtype and alignment, floats by type (Triton never specialises on their value), the launch
    options and the device. A key's first launch is Triton's own (compiling if needed). Triton's
    CPU interpreter (the tests) is never bypassed, nor is a Triton release outside
    `BYPASSED_RELEASES`: how a binary takes its arguments is Triton's internal (see
    `_binary_launch`)."""

    MAX_KEYS = 1024  # forgotten all at once past this (shapes are keys): no growth without bound

    def __init__(self, kernel):
        self.kernel = kernel
        self.__name__ = kernel.__name__  # the tuning tables name kernels (`register_cap`)
        compiled = isinstance(kernel, triton.runtime.JITFunction) and triton.__version__.startswith(BYPASSED_RELEASES)
        self.params = kernel.arg_names if compiled else ()
        self.by_value = tuple(param.is_constexpr for param in kernel.params) if compiled else ()
        self.launches = {} if compiled else None

    def __getitem__(self, grid):
        return functools.partial(self._launch, grid)

    def _launch(self, grid, *args, **kwargs):
        if self.launches is None or not args[0].is_cuda:
            return self.kernel[grid](*args, **kwargs)
        device = torch.cuda.current_device()
        key = (device, tuple(kwargs.items()),
               *(arg if by_value else _specialisation(arg) for arg, by_value in zip(args, self.by_value)))
        launch = self.launches.get(key)
        if launch is None:
            binary = self.kernel[grid](*args, **kwargs)
            if isinstance(binary, triton.compiler.CompiledKernel):
                if len(self.launches) >= self.MAX_KEYS:
                    self.launches.clear()
                self.launches[key] = _binary_launch(binary)
            return
        launch(tuple(grid) + (1,) * (3 - len(grid)), device,
               (*args, *(kwargs[name] for name in self.params[len(args):])))


def _binary_launch(binary):
    """`launch(grid, device, every parameter's value)` of a compiled kernel: its C launcher called
    as Triton's runner calls it (`CompiledKernel.__getitem__`, `CudaLauncher.__call__`), less
    what costs host time there on every launch and serves nothing here: a closure, the launch
    metadata built for the launch hooks (a `LazyDict` a launch, and the two empty hook chains
    called from C), the scratch allocations of kernels that need none. A kernel that needs
    scratch memory, and any launch while a profiler has hooked Triton's launches, take Triton's
    runner."""
    runner = binary.run  # loads the binary's module at its first use
    if runner.global_scratch_size or runner.profile_scratch_size:
        return lambda grid, device, args: binary[grid](*args)
    c_launch, function, metadata = runner.launch, binary.function, binary.packed_metadata
    cooperative, pdl = runner.launch_cooperative_grid, runner.launch_pdl
    current_stream = triton.runtime.driver.active.get_current_stream
    hooks = triton.knobs.runtime
    hooked = lambda: hooks.launch_enter_hook.calls or hooks.launch_exit_hook.calls  # noqa: E731

    if triton.__version__.startswith("3.6."):
        # A launcher compiled for the kernel: (grid, stream, function, cooperative, pdl, global and
        # profile scratch, packed metadata, launch metadata, enter and exit hooks, *parameters).
        def launch(grid, device, args):
            if hooked():
                return binary[grid](*args)
            c_launch(*grid, current_stream(device), function, cooperative, pdl, None, None, metadata, None, None,
                     None, *args)
    else:
        # One launcher for every kernel: (grid, stream, function, cooperative, pdl, packed metadata,
        # launch metadata, enter and exit hooks, global and profile scratch, the parameters'
        # annotations, the kernel's signature, the parameters as a tuple).
        annotations, signature = runner.arg_annotations, runner.kernel_signature

        def launch(grid, device, args):
            if hooked():
                return binary[grid](*args)
            c_launch(*grid, current_stream(device), function, cooperative, pdl, metadata, None, None, None, None,
                     None, annotations, signature, args)
    return launch


def _specialisation(arg):
    """What of a non-constexpr argument a compiled kernel depends on (see `_Launcher`)."""
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    return float if isinstance(arg, float) else arg


# Programmatic dependent launch (PDL, sm_90 and later). A generation step is ~150 dependent kernels
# of a few microseconds each; between two of them the GPU idles through the second's launch and
# first loads (~1.5 us each, 2026-12-05 on an H100). A kernel launched with PDL starts while the
# kernel before it still runs, loads what no kernel writes (its weights) and then waits in each
# program, at `_wait_for_previous_kernel`, for that kernel's end and writes. Used for steps of at
# most this many rows (0: never): on an H100 (2026-12-05, bench_generate, 400m) it cut a step's GPU
# time by 10% at one row and raised tokens/s by 15-26% there, at four rows by 14-15% (gdn, rkla;
# rdn -2%, its GPU time level); at 16 rows, where its early programs hold SMs that the kernel
# before them would use, the residual rules' GPU time rose 6-7%.
PROGRAMMATIC_LAUNCH_MAX_ROWS = 4


@functools.cache
def _capability(device_index):
    return torch.cuda.get_device_capability(device_index)


def programmatic_launch(x):
    """The launch options of a step's kernel for x, whose first dimension is the step's rows:
    {"PDL": whether it launches with PDL}, and Triton's `launch_pdl` when it does (at most
    PROGRAMMATIC_LAUNCH_MAX_ROWS rows, on NVIDIA GPUs from sm_90 on: not ROCm, not the interpreter)."""
    if (x.shape[0] <= PROGRAMMATIC_LAUNCH_MAX_ROWS and x.is_cuda and torch.version.hip is None
            and _capability(x.device.index)[0] >= 9):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@triton.jit
def _wait_for_previous_kernel(PDL: tl.constexpr):
    """Under PDL, each program waits here for the previous kernel of the stream to end (its
    writes visible), then lets the next kernel launch. Every program must pass here before it
    writes anything or ends: the next kernel's programs then start only once this one's previous
    kernel has ended, so that every kernel before the one just before it has ended too. Nothing
    that kernel writes may be read before."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def _on_inputs_device(launcher):
    """Run `launcher` with the CUDA device of its first argument current. Triton launches on the
    current device, not on the tensors': the layers of a model split across GPUs (device_map)
    would have their kernels refused, or run on the wrong GPU's stream. Triton's CPU interpreter
    takes CPU tensors, which need no device."""
    @functools.wraps(launcher)
    def launch(q, *args, **kwargs):
        if not q.is_cuda:
            return launcher(q, *args, **kwargs)
        with torch.cuda.device(q.device):
            return launcher(q, *args, **kwargs)
    return launch
