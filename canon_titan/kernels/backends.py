"""Backends of the sequence-mixing kernels, and the chunking helpers the torch kernels share.

``torch`` is the pure-PyTorch code of this package: any device, any dtype, plain autograd. The CUDA
kernels are Triton kernels: this package's own for the Canon op (``triton``), and other packages'
for the recurrences: ``fla`` (flash-linear-attention: GLA, gated delta rule) and ``mamba_ssm``
(Mamba2 SSD), each called through a torch custom op of this package (so compiled blocks keep no
graph break). They run on CUDA tensors, or on CPU tensors when Triton's interpreter is on
(``TRITON_INTERPRET=1`` before the first import: slow, for tests; ``interpreter`` adapts fla and
mamba-ssm to it).

fla and mamba-ssm are called through their internal forward and backward halves, so only the
versions they were tested with (``TESTED_VERSIONS``) are used: ``auto`` skips another version with a
warning, and a forced backend with another version is a config error.

``auto`` picks the op's CUDA kernel on a GPU when its package imports at the tested version and the
machine is not a known-bad combination (``KNOWN_BAD``), else ``torch``, and says why.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.metadata
import importlib.util
import sys
import types
from dataclasses import dataclass

import torch
import triton
from packaging.version import Version

CUDA_BACKENDS = {"canon": "triton", "gla": "fla", "gated_delta_rule": "fla", "ssd": "mamba_ssm"}
"""Each op's CUDA backend; every op also has ``torch``."""
_CUDA_MODULES = {
    "triton": "triton",
    "fla": "fla.ops",
    "mamba_ssm": "mamba_ssm.ops.triton.ssd_combined",
}
_PACKAGES = {"triton": "triton", "fla": "flash-linear-attention", "mamba_ssm": "mamba-ssm"}
TESTED_VERSIONS = {"fla": "0.6.0", "mamba_ssm": "2.3.2.post1"}
"""The versions of the packages whose internal functions the wrappers call (pyproject's ``gpu``
extra)."""
INTERPRETED = triton.knobs.runtime.interpret
"""Triton decides when a kernel module is imported whether its kernels run in the interpreter."""


def triton_runs_here() -> bool:
    """Triton kernels can run: a CUDA GPU, or the interpreter (CPU tensors)."""
    return torch.cuda.is_available() or INTERPRETED


def _enter_mamba_ssm() -> None:
    """mamba-ssm's package ``__init__`` imports its compiled selective-scan extension, which a
    Triton-only install (``MAMBA_SKIP_CUDA_BUILD=TRUE``: CI, the offline GPU kit) does not have and
    the Triton SSD kernels do not use; when that import fails, the package is entered without its
    ``__init__``."""
    try:
        importlib.import_module("mamba_ssm")
    except ImportError:
        spec = importlib.util.find_spec("mamba_ssm")
        if spec is None or spec.submodule_search_locations is None:
            raise
        for name in [n for n in sys.modules if n == "mamba_ssm" or n.startswith("mamba_ssm.")]:
            del sys.modules[name]
        package = types.ModuleType("mamba_ssm")
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules["mamba_ssm"] = package


def _import(backend: str) -> None:
    if backend == "mamba_ssm":
        _enter_mamba_ssm()
    importlib.import_module(_CUDA_MODULES[backend])


@functools.cache
def import_problem(backend: str) -> str | None:
    """Why the backend's package does not import here, or None."""
    try:
        _import(backend)
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] == _CUDA_MODULES[backend].split(".")[0]:
            return f"{_PACKAGES[backend]}: not installed"
        return f"{type(e).__name__}: {e}"  # the package is there, something it imports is not
    except Exception as e:  # ImportError, or a package that fails while importing
        return f"{type(e).__name__}: {e}"
    return None


def installed_version(backend: str) -> str | None:
    """The version of an imported backend package (its metadata, else its ``__version__``)."""
    try:
        return importlib.metadata.version(_PACKAGES[backend])
    except importlib.metadata.PackageNotFoundError:
        return getattr(sys.modules.get(_CUDA_MODULES[backend].split(".")[0]), "__version__", None)


def version_problem(backend: str) -> str | None:
    """Why the installed version of the backend's package is not used, or None."""
    tested, installed = TESTED_VERSIONS.get(backend), installed_version(backend)
    if tested is None or installed == tested:
        return None
    return (
        f"canon-titan calls internal functions of {_PACKAGES[backend]}, tested with "
        f"version {tested} only; "
        f"this machine has {installed or 'an unknown version'} (another version may fail "
        "inside step 1 or "
        f"compute wrong gradients): install {_PACKAGES[backend]}=={tested}"
    )


@functools.cache
def prepare_kernels(backend: str) -> None:
    """Import the backend's package (see ``import_problem``) ready to run its kernels here: its
    autotuning narrowed and reported (``tuning.watch``); under the interpreter, with the adaptations
    of ``interpreter``."""
    _import(backend)
    if INTERPRETED and backend in TESTED_VERSIONS:
        from canon_titan.kernels import interpreter

        interpreter.prepare(backend)
    if backend in TESTED_VERSIONS:
        from canon_titan.kernels import tuning

        tuning.watch(backend)


@dataclass(frozen=True)
class KernelEnvironment:
    """What decides whether a Triton kernel package runs correctly here."""

    cuda_capability: tuple[int, int] | None
    """Compute capability of the GPU, None without one."""
    interpreter: bool
    triton: str
    tilelang: bool
    """TileLang imports (fla routes some Hopper kernels to it)."""
    planned: bool = False
    """A machine a run is planned for (``canon-titan plan``), not this one: it is taken to have the
    project's ``gpu`` extra at the tested versions, so the packages are not imported here."""

    @classmethod
    @functools.cache
    def _this_machine(cls) -> KernelEnvironment:
        capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
        return cls(
            capability,
            INTERPRETED,
            triton.__version__,
            importlib.util.find_spec("tilelang") is not None,
        )

    @classmethod
    def current(cls) -> KernelEnvironment:
        """This machine's, or the planned machine's inside ``planned_machine``."""
        return _planned[-1] if _planned else cls._this_machine()

    @classmethod
    def planned_gpu(cls, capability: tuple[int, int]) -> KernelEnvironment:
        """A GPU of ``capability`` with this install's Triton and the ``gpu`` extra."""
        return cls(capability, False, triton.__version__, False, planned=True)

    def describe(self) -> str:
        gpu = (
            f"sm_{self.cuda_capability[0]}{self.cuda_capability[1]} GPU"
            if self.cuda_capability
            else "no GPU"
        )
        return f"{gpu}, Triton {self.triton}"


_planned: list[KernelEnvironment] = []


@contextlib.contextmanager
def planned_machine(env: KernelEnvironment):
    """Inside: backends resolve as on ``env``, and every non-torch backend calls its custom op
    whatever the tensors' device. ``canon-titan plan`` traces a GPU run this way on fake tensors,
    where only the ops' fake kernels run (their outputs and saved tensors are the real kernels')."""
    _planned.append(env)
    try:
        yield
    finally:
        _planned.pop()


def _hopper_triton_3_4_to_3_7(env: KernelEnvironment) -> bool:
    return (
        env.cuda_capability is not None
        and env.cuda_capability[0] == 9
        and Version("3.4.0") <= Version(env.triton) < Version("3.7.1")
        and not env.tilelang
    )


KNOWN_BAD = {
    # (backend, op): (condition, what happens and the fix)
    ("fla", "gated_delta_rule"): (
        _hopper_triton_3_4_to_3_7,
        "flash-linear-attention 0.6.0 refuses the backward of chunk_gated_delta_rule on "
        "Hopper GPUs with "
        "Triton >= 3.4 and < 3.7.1 (it computes wrong gradients there; fla issue #640), "
        "so training would stop "
        "inside step 1. Fix: install Triton >= 3.7.1 (a release your torch build "
        "supports), or `pip install "
        "tilelang` (fla then runs that kernel in TileLang), or set [model] kernel_backend "
        '= "torch"',
    ),
}


def backend_problem(backend: str, op: str, env: KernelEnvironment | None = None) -> str | None:
    """Why ``backend`` cannot run ``op`` here (a sentence with the fix), or None."""
    env = env or KernelEnvironment.current()
    if env.cuda_capability is None and not env.interpreter:
        return (
            f"{op} backend {backend!r} runs Triton kernels, which need a CUDA GPU; without "
            "one, set "
            "TRITON_INTERPRET=1 to run them on the CPU (slow, for testing), or use "
            "'torch' or 'auto'"
        )
    problem = None if env.planned else import_problem(backend)
    if problem:
        return (
            f"{op} backend {backend!r} needs the {_PACKAGES[backend]} package, which does "
            "not import here "
            f"({problem}); use 'torch' or 'auto'"
        )
    problem = None if env.planned else version_problem(backend)
    if problem:
        return f"{op} backend {backend!r}: {problem}, or use 'torch' or 'auto'"
    condition, message = KNOWN_BAD.get((backend, op), (None, None))
    if condition is not None and condition(env):
        return f"{message} (this machine: {env.describe()})"
    return None


def resolve_backend(
    requested: str, *, op: str, env: KernelEnvironment | None = None, check: bool = True
) -> tuple[str, str | None]:
    """The backend that runs ``op`` (one of ``CUDA_BACKENDS``) here, and why ``auto`` did not pick
    the CUDA kernel (None otherwise). A forced CUDA backend that cannot run is a ValueError, unless
    ``check`` is off (a model built for another machine: its config checks judge the backend
    there)."""
    cuda_backend = CUDA_BACKENDS[op]
    allowed = ("auto", "torch", cuda_backend)
    if requested not in allowed:
        raise ValueError(
            f"must be one of {', '.join(map(repr, allowed))} for {op}, got {requested!r}"
        )
    if requested == "torch":
        return "torch", None
    env = env or KernelEnvironment.current()
    if requested == cuda_backend:
        problem = backend_problem(cuda_backend, op, env) if check else None
        if problem:
            raise ValueError(problem)
        return cuda_backend, None
    if env.cuda_capability is None:
        return "torch", "no GPU"
    problem = backend_problem(cuda_backend, op, env)
    return ("torch", problem) if problem else (cuda_backend, None)


def runs_cuda_kernel(backend: str, t: torch.Tensor) -> bool:
    """Whether a resolved backend's Triton kernel runs on ``t``: its device, or the interpreter on
    CPU (a model configured for the GPU and evaluated on a CPU falls back to torch); on any tensor
    inside ``planned_machine``."""
    if backend == "torch":
        return False
    return bool(_planned) or t.is_cuda or (t.device.type == "cpu" and INTERPRETED)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half inputs; float64 stays float64 so tests can compare in double."""
    return torch.promote_types(dtype, torch.float32)


def to_chunks(x: torch.Tensor, chunk_size: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, T, H, ...] -> [B, H, N, chunk_size, ...], zero-padded at the end of time.

    Zero padding is neutral for every op here: zero keys/values/dt add nothing to the state and a
    zero log-decay keeps it, so the final state is the one after the last real token.
    """
    x = x.transpose(1, 2).to(dtype)
    pad = -x.shape[2] % chunk_size
    if pad:
        x = torch.cat([x, x.new_zeros(*x.shape[:2], pad, *x.shape[3:])], dim=2)
    return x.unflatten(2, (-1, chunk_size))


def from_chunks(y: torch.Tensor, seq_len: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, H, N, C, D] -> [B, seq_len, H, D], dropping the padding."""
    return y.flatten(2, 3)[:, :, :seq_len].transpose(1, 2).to(dtype)


def decay_matrix(log_decay_cumsum: torch.Tensor) -> torch.Tensor:
    """[..., C] cumulative log decays -> [..., C, C] with exp(b_i - b_j) for j <= i, else 0.

    The exponent is masked before exp, so only differences <= 0 are exponentiated: no overflow, and
    no inf * 0 = nan in the backward.
    """
    b = log_decay_cumsum
    causal = torch.ones(b.shape[-1], b.shape[-1], dtype=torch.bool, device=b.device).tril()
    return (b.unsqueeze(-1) - b.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()


def scan_states(
    decay: torch.Tensor, updates: torch.Tensor, initial: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """S_n = decay_n * S_{n-1} + updates_n along dim 2 (the chunk index).

    Returns the state entering each chunk, stacked on dim 2, and the state after the last chunk.
    """
    state = (
        updates.new_zeros(updates[:, :, 0].shape) if initial is None else initial.to(updates.dtype)
    )
    entering = []
    # unbind, not indexing: the backward of each index would write a whole zero tensor.
    for decay_n, update_n in zip(decay.unbind(2), updates.unbind(2)):
        entering.append(state)
        state = decay_n * state + update_n
    return torch.stack(entering, dim=2), state
