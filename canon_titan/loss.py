"""Training losses beyond TorchTitan's plain cross-entropy."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from torchtitan.components.loss import IGNORE_INDEX, BaseLoss
from torchtitan.config import CompileConfig


def squared_nll_loss(pred: torch.Tensor, labels: torch.Tensor, coefficient: float) -> torch.Tensor:
    """Sum over tokens of ``l + coefficient * l**2`` with ``l`` the per-token NLL (fp32).

    This is the reference's ``z_loss`` (PhysicsLM4 / Lingua): it squares the cross-entropy,
    not PaLM's ``log Z``. Ignored labels contribute nothing.
    """
    nll = F.cross_entropy(
        pred.flatten(0, 1).float(), labels.flatten(0, 1), reduction="none", ignore_index=IGNORE_INDEX
    )
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
