from dataclasses import dataclass

import torch
import torch.nn as nn

from torchtitan.protocols.module import Module


class RMSNorm(Module):
    """RMSNorm computed in float32 and cast back, as the reference (Lingua) does.

    ``torch.nn.RMSNorm`` normalises in the input dtype, which under bf16 mixed precision gives
    different numerics from the released models.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        dim: int
        eps: float = 1e-5

    def __init__(self, config: Config):
        super().__init__()
        self.eps = config.eps
        self.weight = nn.Parameter(torch.empty(config.dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight.float()).type_as(x)
