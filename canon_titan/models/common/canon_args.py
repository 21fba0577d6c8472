"""The ``[model]`` keys of the Canon layers (``CanonArgs``, shared by LlamaCanon and the linear
models). Importing this does not import the model stack (``models/common/deferred.py``): the
config checks read these args before anything is built."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from canon_titan.kernels.backends import resolve_backend
from canon_titan.models.common.deferred import deferred
from canon_titan.models.common.init import conv_init

canon_layer = deferred("canon_titan.models.common.canon")

CANON_POSITIONS = "ABCD"
CANON_KERNEL_SIZES = (2, 3, 4)


def conv_backend(requested: str) -> str:
    """The backend of Canon layers for ``[model] canon_backend`` ('auto' decided for this machine;
    whether a forced one runs here is for ``CanonArgs.canon_problems``)."""
    return resolve_backend(requested, op="canon", check=False)[0]


@dataclass(kw_only=True)
class CanonArgs:
    """The ``[model]`` keys of the Canon layers, shared by LlamaCanon and the linear models."""

    canon_set: str = "ABCD"
    """Canon positions to enable."""
    canon_kernel: int = 4
    canon_residual: bool = True
    canon_activation: bool = False
    canon_bias: bool = False
    canon_backend: str = "auto"
    """'auto' (the Triton kernels on a CUDA GPU, else torch), 'torch' or 'triton'."""

    canon_letters: ClassVar[str] = CANON_POSITIONS
    """The letters ``canon_set`` may use."""
    canon_set_note: ClassVar[str] = ""
    """Said after the letters when ``canon_set`` is wrong."""

    def enabled(self) -> set[str]:
        """The positions ``canon_set`` enables."""
        return set(self.canon_set)

    def canon_problems(self) -> list[tuple[str, str]]:
        """(key, message) pairs for the Canon keys."""
        problems = []
        letters = "".join(sorted(self.enabled()))
        if any(c not in self.canon_letters for c in letters) or len(letters) != len(
            self.canon_set.replace("bb", "b")
        ):
            problems.append(
                (
                    "canon_set",
                    f"must be distinct letters from {self.canon_letters!r}{self.canon_set_note}, "
                    f"got {self.canon_set!r}",
                )
            )
        if self.canon_kernel not in CANON_KERNEL_SIZES:
            problems.append(("canon_kernel", f"must be 2, 3 or 4, got {self.canon_kernel}"))
        if self.canon_backend == "causal_conv1d":
            problems.append(
                (
                    "canon_backend",
                    "'causal_conv1d' was removed: its [batch, channel, seq] kernel needed "
                    "transposes and graph breaks; 'triton' (or 'auto' on a GPU) is the fused "
                    "kernel that replaces it",
                )
            )
        else:
            try:
                resolve_backend(self.canon_backend, op="canon")
            except ValueError as e:
                problems.append(("canon_backend", str(e)))
        return problems

    def canon(self, position: str, channels: int) -> canon_layer.CanonConv.Config | None:
        """The Canon layer at ``position``, or None where ``canon_set`` has none."""
        if position not in self.enabled():
            return None
        return canon_layer.CanonConv.Config(
            channels=channels,
            kernel_size=self.canon_kernel,
            residual=self.canon_residual,
            activation=self.canon_activation,
            bias=self.canon_bias,
            backend=conv_backend(self.canon_backend),
            param_init=conv_init(self.canon_kernel),
        )

    def describe_canon(self) -> str:
        return (
            f"canon_set {self.canon_set!r} (kernel {self.canon_kernel}, residual "
            f"{self.canon_residual}, "
            f"activation {self.canon_activation}, bias {self.canon_bias}), conv backend "
            f"{conv_backend(self.canon_backend)} (requested {self.canon_backend})"
        )
