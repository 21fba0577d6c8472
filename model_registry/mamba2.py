"""``mamba2``: Mamba2 (one B/C group, state 128, head_dim 256, SwiGLU MLP "mlp10") of the
PhysicsLM4 linear-model release (spec 5.4, 5.5, 5.7); canon_set 'AbbCD' for the Canon models,
'bb' for the conv baselines."""

from canon_titan.models.mamba2.args import Mamba2Args

__all__ = ["ARGS", "FLAVORS"]

ARGS = Mamba2Args

FLAVORS: dict[str, Mamba2Args] = {
    # Tiny CPU model: 4 heads of 64 channels, state 32, two chunks of a 128-token sequence.
    "debug": Mamba2Args(
        dim=128, n_layers=4, n_heads=4, vocab_size=2048, state_size=32, chunk_size=64
    ),
    "1B": Mamba2Args(dim=2048, n_layers=24, n_heads=16, vocab_size=32000),
    "3B": Mamba2Args(dim=3072, n_layers=26, n_heads=24, vocab_size=32000),
    "8B": Mamba2Args(dim=4096, n_layers=32, n_heads=32, ffn_hidden_dim=9472, vocab_size=128256),
}
