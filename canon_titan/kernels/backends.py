"""Backends of the linear-attention kernels, and the chunking helpers the torch kernels share.

``torch`` is the chunked pure-PyTorch code of this package: any device, any dtype, plain autograd.
The CUDA kernels are ``fla`` (flash-linear-attention: GLA, gated delta rule) and ``mamba_ssm``
(Mamba2 SSD). They run only on CUDA tensors; ``auto`` picks the op's CUDA kernel when the tensors
are on CUDA and its package imports, else ``torch``.
"""

from __future__ import annotations

import functools
import importlib

import torch

CUDA_BACKENDS = {"gla": "fla", "gated_delta_rule": "fla", "ssd": "mamba_ssm"}
_CUDA_MODULES = {"fla": "fla.ops", "mamba_ssm": "mamba_ssm.ops.triton.ssd_combined"}
_PACKAGES = {"fla": "flash-linear-attention", "mamba_ssm": "mamba-ssm"}


@functools.cache
def _importable(backend: str) -> bool:
    try:
        importlib.import_module(_CUDA_MODULES[backend])
    except ImportError:
        return False
    return True


def resolve_backend(requested: str, device: torch.device | str, *, op: str) -> str:
    """The backend that runs ``op`` ("gla", "gated_delta_rule" or "ssd") on tensors on ``device``."""
    cuda_backend = CUDA_BACKENDS[op]
    allowed = ("auto", "torch", cuda_backend)
    if requested not in allowed:
        raise ValueError(f"{op} backend must be one of {allowed}, got {requested!r}")
    if requested == "torch":
        return "torch"
    on_cuda = torch.device(device).type == "cuda"
    if requested == cuda_backend:
        if not on_cuda:
            raise ValueError(f"{op} backend {cuda_backend!r} runs on CUDA tensors only, got tensors on {device}; "
                             "use 'torch' or 'auto'")
        if not _importable(cuda_backend):
            raise ValueError(f"{op} backend {cuda_backend!r} needs the {_PACKAGES[cuda_backend]} package, "
                             "which does not import here; use 'torch' or 'auto'")
    return cuda_backend if on_cuda and _importable(cuda_backend) else "torch"


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


def scan_states(decay: torch.Tensor, updates: torch.Tensor,
                initial: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """S_n = decay_n * S_{n-1} + updates_n along dim 2 (the chunk index).

    Returns the state entering each chunk, stacked on dim 2, and the state after the last chunk.
    """
    state = updates.new_zeros(updates[:, :, 0].shape) if initial is None else initial.to(updates.dtype)
    entering = []
    # unbind, not indexing: the backward of each index would write a whole zero tensor.
    for decay_n, update_n in zip(decay.unbind(2), updates.unbind(2)):
        entering.append(state)
        state = decay_n * state + update_n
    return torch.stack(entering, dim=2), state
