"""Parameter initialisations of the models, as TorchTitan ``param_init`` dicts and functions (the
args build model configs from them; nothing here imports the model stack)."""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn as nn


def truncated_normal_init(std: float) -> dict:
    """Lingua's init: normal(0, std) truncated at +-3 std."""
    return {"weight": partial(nn.init.trunc_normal_, std=std, a=-3 * std, b=3 * std)}


ONES_INIT = {"weight": nn.init.ones_}


def canon_weight_init(weight: torch.Tensor) -> None:
    """``nn.Conv1d``'s default: kaiming-uniform with a=sqrt(5), i.e. U(-1/sqrt(K), 1/sqrt(K))."""
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))


def canon_bias_init(bias: torch.Tensor, kernel_size: int) -> None:
    bound = 1 / math.sqrt(kernel_size)
    nn.init.uniform_(bias, -bound, bound)


def conv_init(kernel_size: int) -> dict:
    """PyTorch's default ``nn.Conv1d`` initialisation of weight and bias."""
    return {"weight": canon_weight_init, "bias": partial(canon_bias_init, kernel_size=kernel_size)}


def normal_init(std: float) -> dict:
    """N(0, std) weights, zero biases: the release's ``_init_weights`` for GLA/GDN linears."""
    return {"weight": partial(nn.init.normal_, std=std), "bias": nn.init.zeros_}


def torch_default_init() -> dict:
    """PyTorch's own Linear/Conv1d init: U(+-1/sqrt(fan_in)) weights; Mamba2's linears (bias
    zero)."""
    return {"weight": canon_weight_init, "bias": nn.init.zeros_}


def split_init(std: float, rank: int) -> dict:
    """The release's ``zeyuan_split_init``: both factors of a rank-r product get std sqrt(std) /
    r^(1/4), so the product has about the variance of one full matrix with std ``std``."""
    return normal_init(math.sqrt(std) / rank**0.25)


@torch.no_grad()
def log_uniform_init(param: torch.Tensor, low: float, high: float) -> None:
    """log U(low, high), in place (works on sharded DTensors too): GDN2's and Mamba2's A_log."""
    nn.init.uniform_(param, low, high).log_()


@torch.no_grad()
def dt_bias_init(
    param: torch.Tensor, dt_min: float = 0.001, dt_max: float = 0.1, floor: float = 1e-4
) -> None:
    """softplus^-1(dt) for dt log-uniform in [dt_min, dt_max], floored (Mamba2's time-step init)."""
    nn.init.uniform_(param, math.log(dt_min), math.log(dt_max)).exp_().clamp_(min=floor)
    param.copy_(param + torch.log(-torch.expm1(-param)))
