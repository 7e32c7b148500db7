"""kernels_reslin_triton._Launcher: a specialisation's later launches go to the binary its first
(Triton's own) launch returned, and anything a compiled kernel depends on makes a new key.

On a CPU there is no binary to launch: Triton's side is a recorder here, and the first argument
a CPU tensor that says it is on CUDA. The GPU tests run every kernel through the real thing."""

import pytest
import torch

import kernels_reslin
import kernels_reslin_triton

pytestmark = pytest.mark.skipif(kernels_reslin.triton_decode_step is None, reason="needs the triton package")
triton = pytest.importorskip("triton")
tl = triton.language


def _kernel(x_ptr, n, scale, BLOCK: tl.constexpr, FACTOR: tl.constexpr):
    pass


class _OnCuda(torch.Tensor):
    @property
    def is_cuda(self):
        return True


class _Recorder:
    """Triton's launch path, `kernel[grid](...)`, and the binaries it returns."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append(("triton", grid, args, kwargs))
            return _Binary(self)
        return launch


class _Binary(triton.compiler.CompiledKernel):
    def __init__(self, recorder):
        self.recorder = recorder

    def __getitem__(self, grid):
        return lambda *args: self.recorder.launches.append(("binary", grid, args))


@pytest.fixture
def launcher(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    launcher = kernels_reslin_triton._Launcher(triton.runtime.JITFunction(_kernel))
    assert launcher.binaries == {} and launcher.by_value == (False, False, False, True, True)
    launcher.kernel = _Recorder()
    return launcher


def _paths(launcher):
    return [launch[0] for launch in launcher.kernel.launches]


def test_a_specialisation_launches_its_binary_after_the_first_launch(launcher):
    x = torch.zeros(64).as_subclass(_OnCuda)
    launcher[(4,)](x, 64, 0.5, BLOCK=16, FACTOR=2.0, num_warps=4)
    launcher[(8, 2)](x, 64, 0.25, BLOCK=16, FACTOR=2.0, num_warps=4)  # a float's value is no key
    assert _paths(launcher) == ["triton", "binary"]
    path, grid, args = launcher.kernel.launches[1]
    assert grid == (8, 2, 1)
    assert args[0] is x and args[1:] == (64, 0.25, 16, 2.0)  # every parameter in order, no options


@pytest.mark.parametrize("change", ["integer", "constexpr", "constexpr float", "option", "dtype", "alignment"])
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
    launcher.binaries = None  # as for an interpreted kernel
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
    assert launcher.binaries == {} and _paths(launcher) == ["triton", "triton"]


def test_other_triton_versions_take_tritons_path(monkeypatch):
    monkeypatch.setattr(triton, "__version__", "3.5.1")
    assert kernels_reslin_triton._Launcher(triton.runtime.JITFunction(_kernel)).binaries is None


def test_the_keys_are_forgotten_past_their_limit(launcher, monkeypatch):
    monkeypatch.setattr(kernels_reslin_triton._Launcher, "MAX_KEYS", 3)
    x = torch.zeros(64).as_subclass(_OnCuda)
    for n in range(5):
        launcher[(1,)](x, n, 0.5, BLOCK=16, FACTOR=2.0)
    assert len(launcher.binaries) == 2  # cleared at the fourth key
    launcher[(1,)](x, 4, 0.5, BLOCK=16, FACTOR=2.0)
    assert _paths(launcher) == ["triton"] * 5 + ["binary"]
