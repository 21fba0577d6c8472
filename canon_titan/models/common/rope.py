from dataclasses import dataclass

import torch
from torchtitan.protocols.module import Module


class PartialRoPE(Module):
    """Rotary embedding on the first ``rope_dim`` channels of each head (interleaved pairs).

    Channels (2i, 2i+1) of a head form pair i and rotate by ``pos * theta^(-2i/rope_dim)``;
    channels at or beyond ``rope_dim`` pass through unchanged. ``rope_dim == head_dim`` is the
    usual full RoPE in the Lingua / TorchTitan layout (not Hugging Face's rotate-half layout).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        rope_dim: int
        theta: float = 10000.0
        max_seq_len: int = 4096

        def __post_init__(self):
            if self.rope_dim <= 0 or self.rope_dim % 2:
                raise ValueError(f"rope_dim must be a positive even number, got {self.rope_dim}")

    def __init__(self, config: Config):
        super().__init__()
        self.rope_dim = config.rope_dim
        self.theta = config.theta
        self.max_seq_len = config.max_seq_len
        cos, sin = self._tables(None)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _tables(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        half = torch.arange(0, self.rope_dim, 2, device=device, dtype=torch.float32)
        inv_freq = 1.0 / (self.theta ** (half / self.rope_dim))
        angles = torch.outer(
            torch.arange(self.max_seq_len, device=device, dtype=torch.float32), inv_freq
        )
        return angles.cos(), angles.sin()

    def _init_self_buffers(self, *, buffer_device=None) -> None:
        device = buffer_device if buffer_device is not None else self.cos.device
        self.cos, self.sin = self._tables(device)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rot, keep = x[..., : self.rope_dim], x[..., self.rope_dim :]
        pairs = rot.float().unflatten(-1, (-1, 2))
        x0, x1 = pairs[..., 0], pairs[..., 1]
        rotated = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)
        return torch.cat((rotated.type_as(x), keep), dim=-1)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k: [batch, seq, heads, head_dim]; positions: [batch, seq] or None for 0..seq-1."""
        seq_len = q.shape[1]
        if positions is None:
            cos, sin = self.cos[:seq_len, None, :], self.sin[:seq_len, None, :]
        else:
            cos, sin = self.cos[positions].unsqueeze(2), self.sin[positions].unsqueeze(2)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)
