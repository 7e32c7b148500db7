"""kernels_reslin_triton_launch._Launcher: a specialisation's later launches go to the binary its first
(Triton's own) launch returned, and anything a compiled kernel depends on makes a new key.

On a CPU there is no binary to launch: Triton's side is a recorder here, and the first argument
a CPU tensor that says it is on CUDA. What the bypass passes a binary's C launcher is checked
against what the installed release's own runner (its CudaLauncher, with the C launcher
recording) passes for the same launch. The GPU tests run every kernel through the real thing."""

import types

import pytest
import torch

import kernels_reslin
import kernels_reslin_triton_launch

pytestmark = pytest.mark.skipif(kernels_reslin.triton_decode_step is None, reason="needs the triton package")
triton = pytest.importorskip("triton")
tl = triton.language
CudaLauncher = pytest.importorskip("triton.backends.nvidia.driver").CudaLauncher
bypassed = triton.__version__.startswith(kernels_reslin_triton_launch.BYPASSED_RELEASES)


def _kernel(x_ptr, n, scale, BLOCK: tl.constexpr, FACTOR: tl.constexpr):
    pass


class _OnCuda(torch.Tensor):
    @property
    def is_cuda(self):
        return True


class _Recorder:
    """Triton's launch path, `kernel[grid](...)`, and the binaries it returns."""

    def __init__(self, scratch=0, pdl=False):
        self.launches = []
        self.scratch = scratch
        self.pdl = pdl  # whether the binaries were compiled with launch_pdl

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append(("triton", grid, args, kwargs))
            return _Binary(self, self.scratch, self.pdl)
        return launch


def _runner(c_launch, scratch=0, pdl=False):
    """The installed release's CudaLauncher (a binary's `run`) around the C launcher `c_launch`,
    with the attributes its constructor would read from a compiled kernel."""
    runner = object.__new__(CudaLauncher)
    vars(runner).update(launch=c_launch, num_ctas=1, global_scratch_size=scratch, global_scratch_align=1,
                        profile_scratch_size=0, profile_scratch_align=1, launch_cooperative_grid=False,
                        launch_pdl=pdl, arg_annotations="annotations", kernel_signature=b"signature")
    return runner


def _tritons_c_arguments(grid, stream, args, pdl=False):
    """What the release's own runner passes the C launcher for a launch of `args` (as
    CompiledKernel.__getitem__ calls it, no profiler hooked)."""
    passed = []
    _runner(lambda *c_args: passed.append(c_args), pdl=pdl)(*grid, stream, "function", _Binary.packed_metadata, None,
                                                             None, None, *args)
    return passed[0]


class _Binary(triton.compiler.CompiledKernel):
    """A binary whose C launcher records its launches, with Triton's runner (`binary[grid]`)
    recording its own."""
    function, packed_metadata = "function", (4, 1, 0)

    def __init__(self, recorder, scratch, pdl):
        self.recorder = recorder
        self.scratch = scratch
        self.pdl = pdl

    @property
    def run(self):
        return _runner(self._c_launch, self.scratch, self.pdl)

    def _c_launch(self, *args):
        self.recorder.launches.append(("binary", args))

    def __getitem__(self, grid):
        return lambda *args: self.recorder.launches.append(("runner", grid, args))


@pytest.fixture
def launcher(monkeypatch):
    if not bypassed:
        pytest.skip(f"triton {triton.__version__} is not bypassed (BYPASSED_RELEASES)")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(triton.runtime.driver, "_active", types.SimpleNamespace(get_current_stream=lambda device: 7))
    launcher = kernels_reslin_triton_launch._Launcher(triton.runtime.JITFunction(_kernel))
    assert launcher.launches == {} and launcher.by_value == (False, False, False, True, True)
    launcher.kernel = _Recorder()
    return launcher


def _paths(launcher):
    return [launch[0] for launch in launcher.kernel.launches]


def test_a_specialisation_launches_its_binary_after_the_first_launch(launcher):
    x = torch.zeros(64).as_subclass(_OnCuda)
    launcher[(4,)](x, 64, 0.5, BLOCK=16, FACTOR=2.0, num_warps=4)
    launcher[(8, 2)](x, 64, 0.25, BLOCK=16, FACTOR=2.0, num_warps=4)  # a float's value is no key
    assert _paths(launcher) == ["triton", "binary"]
    # Every parameter in order, no options, laid out as the release's own runner lays them out.
    assert launcher.kernel.launches[1][1] == _tritons_c_arguments((8, 2, 1), 7, (x, 64, 0.25, 16, 2.0))


def test_a_programmatic_launch_reaches_the_binary_as_tritons_runner_passes_it(launcher):
    launcher.kernel = _Recorder(pdl=True)  # binaries compiled with launch_pdl
    x = torch.zeros(64).as_subclass(_OnCuda)
    for _ in range(2):
        launcher[(4,)](x, 64, 0.5, BLOCK=16, FACTOR=2.0, launch_pdl=True)
    assert _paths(launcher) == ["triton", "binary"]
    assert launcher.kernel.launches[0][3]["launch_pdl"] is True  # Triton's first launch compiled with it
    assert launcher.kernel.launches[1][1] == _tritons_c_arguments((4, 1, 1), 7, (x, 64, 0.5, 16, 2.0), pdl=True)


def test_programmatic_launch_only_on_cuda_from_sm90_and_up_to_its_rows(monkeypatch):
    on_cuda = torch.zeros(4).as_subclass(_OnCuda)
    monkeypatch.setattr(kernels_reslin_triton_launch, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(kernels_reslin_triton_launch, "PROGRAMMATIC_LAUNCH_MAX_ROWS", 0)
    assert kernels_reslin_triton_launch.programmatic_launch(on_cuda) == {"PDL": False}  # switched off
    monkeypatch.setattr(kernels_reslin_triton_launch, "PROGRAMMATIC_LAUNCH_MAX_ROWS", 4)
    assert kernels_reslin_triton_launch.programmatic_launch(on_cuda) == {"PDL": True, "launch_pdl": True}
    five_rows = torch.zeros(5, 1, 8).as_subclass(_OnCuda)
    assert kernels_reslin_triton_launch.programmatic_launch(five_rows) == {"PDL": False}  # past the rows
    assert kernels_reslin_triton_launch.programmatic_launch(torch.zeros(4)) == {"PDL": False}  # interpreter
    monkeypatch.setattr(torch.version, "hip", "6.4")
    assert kernels_reslin_triton_launch.programmatic_launch(on_cuda) == {"PDL": False}  # ROCm: no griddepcontrol
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(kernels_reslin_triton_launch, "_capability", lambda index: (8, 0))
    assert kernels_reslin_triton_launch.programmatic_launch(on_cuda) == {"PDL": False}  # before sm_90


def test_a_profilers_launch_hooks_take_tritons_runner(launcher, monkeypatch):
    x = torch.zeros(64).as_subclass(_OnCuda)
    launcher[(4,)](x, 64, 0.5, BLOCK=16, FACTOR=2.0)
    monkeypatch.setattr(triton.knobs.runtime.launch_enter_hook, "calls", [lambda metadata: None])
    launcher[(4,)](x, 64, 0.5, BLOCK=16, FACTOR=2.0)
    assert _paths(launcher) == ["triton", "runner"]


def test_a_kernel_needing_scratch_memory_takes_tritons_runner(launcher):
    launcher.kernel = _Recorder(scratch=256)
    x = torch.zeros(64).as_subclass(_OnCuda)
    for _ in range(2):
        launcher[(4,)](x, 64, 0.5, BLOCK=16, FACTOR=2.0)
    assert _paths(launcher) == ["triton", "runner"]


@pytest.mark.parametrize("change", ["integer", "constexpr", "constexpr float", "option", "pdl", "dtype",
                                    "alignment"])
def test_whatever_a_compiled_kernel_depends_on_makes_a_new_key(launcher, change):
    x = torch.zeros(64).as_subclass(_OnCuda)
    launch = dict(args=(x, 64, 0.5), kwargs=dict(BLOCK=16, FACTOR=2.0, num_warps=4))
    launcher[(1,)](*launch["args"], **launch["kwargs"])
    if change == "integer":
        launch["args"] = (x, 65, 0.5)
    elif change == "constexpr":
        launch["kwargs"]["BLOCK"] = 32
    elif change == "constexpr float":
        launch["kwargs"]["FACTOR"] = 3.0
    elif change == "option":
        launch["kwargs"]["num_warps"] = 8
    elif change == "pdl":
        launch["kwargs"]["launch_pdl"] = True
    elif change == "dtype":
        launch["args"] = (x.to(torch.float16), 64, 0.5)
    else:  # 4 bytes past a 16-byte boundary
        launch["args"] = (x[1:], 64, 0.5)
    launcher[(1,)](*launch["args"], **launch["kwargs"])
    assert _paths(launcher) == ["triton", "triton"]


def test_cpu_tensors_and_the_interpreter_always_take_tritons_path(launcher):
    x = torch.zeros(64)
    for _ in range(2):
        launcher[(1,)](x, 64, 0.5, BLOCK=16, FACTOR=2.0)
    launcher.launches = None  # as for an interpreted kernel
    on_cuda = x.as_subclass(_OnCuda)
    for _ in range(2):
        launcher[(1,)](on_cuda, 64, 0.5, BLOCK=16, FACTOR=2.0)
    assert _paths(launcher) == ["triton"] * 4


class _ReturnsNothing(_Recorder):
    def __getitem__(self, grid):
        launch = super().__getitem__(grid)

        def launch_returning_nothing(*args, **kwargs):
            launch(*args, **kwargs)
        return launch_returning_nothing


def test_only_tritons_compiled_binaries_are_kept(launcher):
    launcher.kernel = _ReturnsNothing()
    x = torch.zeros(64).as_subclass(_OnCuda)
    for _ in range(2):
        launcher[(1,)](x, 64, 0.5, BLOCK=16, FACTOR=2.0)
    assert launcher.launches == {} and _paths(launcher) == ["triton", "triton"]


def test_other_triton_versions_take_tritons_path(monkeypatch):
    monkeypatch.setattr(triton, "__version__", "3.5.1")
    assert kernels_reslin_triton_launch._Launcher(triton.runtime.JITFunction(_kernel)).launches is None


def test_the_keys_are_forgotten_past_their_limit(launcher, monkeypatch):
    monkeypatch.setattr(kernels_reslin_triton_launch._Launcher, "MAX_KEYS", 3)
    x = torch.zeros(64).as_subclass(_OnCuda)
    for n in range(5):
        launcher[(1,)](x, n, 0.5, BLOCK=16, FACTOR=2.0)
    assert len(launcher.launches) == 2  # cleared at the fourth key
    launcher[(1,)](x, 4, 0.5, BLOCK=16, FACTOR=2.0)
    assert _paths(launcher) == ["triton"] * 5 + ["binary"]
