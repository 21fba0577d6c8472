"""Training losses beyond TorchTitan's plain cross-entropy."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard
from torchtitan.components.loss import IGNORE_INDEX, BaseLoss, _LossParallelCrossEntropy
from torchtitan.config import CompileConfig


def token_nll(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token NLL in fp32 (0 for ignored labels); vocab-parallel when ``pred`` is a DTensor
    sharded over the vocabulary (tensor parallelism)."""
    if isinstance(pred, DTensor):
        if tuple(pred.placements) != (Shard(pred.ndim - 1),):
            raise ValueError(f"expected logits sharded on the vocabulary, got {pred.placements}")
        return _LossParallelCrossEntropy.apply(
            pred.to_local().flatten(0, 1).float(),
            labels.flatten(0, 1),
            pred.device_mesh.get_group(),
            pred.shape[-1],
            "none",
        )
    return F.cross_entropy(
        pred.flatten(0, 1).float(),
        labels.flatten(0, 1),
        reduction="none",
        ignore_index=IGNORE_INDEX,
    )


def squared_nll_loss(pred: torch.Tensor, labels: torch.Tensor, coefficient: float) -> torch.Tensor:
    """Sum over tokens of ``l + coefficient * l**2`` with ``l`` the per-token NLL (fp32).

    This is the reference's ``z_loss`` (PhysicsLM4 / Lingua): it squares the cross-entropy,
    not PaLM's ``log Z``. Ignored labels contribute nothing.
    """
    nll = token_nll(pred, labels)
    return (nll + coefficient * nll.square()).sum()


class ZLossCrossEntropy(BaseLoss):
    """Cross-entropy plus the reference's squared-NLL ``z_loss``, normalised by global tokens."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseLoss.Config):
        coefficient: float = 1e-4

    def __init__(self, config: Config, *, compile_config: CompileConfig | None = None):
        coefficient = config.coefficient

        def fn(pred, labels):
            return squared_nll_loss(pred, labels, coefficient)

        self.fn = fn
        self._maybe_compile(compile_config)

    def __call__(self, pred, labels, global_valid_tokens=None, *, z_loss: bool = True, **kwargs):
        """TorchTitan's loss call; ``z_loss=False`` (validation, which normalises by its own token
        count) gives the summed plain cross-entropy, as TorchTitan's CrossEntropyLoss does without
        ``global_valid_tokens``."""
        if z_loss:
            return super().__call__(pred, labels, global_valid_tokens, **kwargs)
        return token_nll(pred, labels).sum(), {}
