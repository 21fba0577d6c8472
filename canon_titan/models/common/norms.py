from dataclasses import dataclass

import torch
import torch.nn as nn
from torchtitan.protocols.module import Module

from canon_titan.models.common.tensor_parallel import local, tp_sum


class RMSNorm(Module):
    """RMSNorm computed in float32 and cast back, as the reference (Lingua) does.

    ``torch.nn.RMSNorm`` normalises in the input dtype, which under bf16 mixed precision gives
    different numerics from the released models. With ``tp_group`` set (flat QK-norm under tensor
    parallelism) each rank holds a slice of the channels and the mean square is summed over the
    group, so the statistic still spans every head.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        dim: int
        eps: float = 1e-5

    def __init__(self, config: Config):
        super().__init__()
        self.eps = config.eps
        self.weight = nn.Parameter(torch.empty(config.dim))
        self.tp_group = None

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def square_sum(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the statistic: the sum of ``x^2`` over its channels, float32, [...,
        1]."""
        return x.float().pow(2).sum(-1, keepdim=True)

    def inverse_rms(self, x: torch.Tensor, square_sum: torch.Tensor | None = None) -> torch.Tensor:
        """``1 / sqrt(mean(x^2) + eps)`` over the channels (all ranks' channels with ``tp_group``),
        float32, [..., 1]. Canon layers after the norm take it and the weight to fuse the norm;
        Canon-B passes ``square_sum`` already summed over the group (with its other sums, in one
        collective)."""
        if self.tp_group is None:
            mean_square = x.float().pow(2).mean(-1, keepdim=True)
        else:
            if square_sum is None:
                square_sum = tp_sum(self.square_sum(x), self.tp_group)
            mean_square = square_sum / (
                x.shape[-1] * torch.distributed.get_world_size(self.tp_group)
            )
        return torch.rsqrt(mean_square + self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.float() * self.inverse_rms(x) * local(self.weight, x).float()).type_as(x)
