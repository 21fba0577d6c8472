"""``llama``: the vanilla Llama baseline of the PhysicsLM4 release (spec section 4)."""

from canon_titan.models.llama.args import LlamaArgs

__all__ = ["ARGS", "FLAVORS"]

ARGS = LlamaArgs

FLAVORS: dict[str, LlamaArgs] = {
    # Tiny CPU model with the 1B recipe's features (GQA added so it is exercised too).
    "debug": LlamaArgs(
        dim=128,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        ffn_hidden_dim=384,
        vocab_size=2048,
        qk_norm=True,
        z_loss=True,
        max_seq_len=256,
    ),
    "1B": LlamaArgs(dim=2048, n_layers=24, n_heads=32, vocab_size=32000, qk_norm=True, z_loss=True),
    "3B": LlamaArgs(dim=3072, n_layers=26, n_heads=24, vocab_size=32000, qk_norm=True, z_loss=True),
    "8B": LlamaArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_hidden_dim=14336,
        vocab_size=128256,
        rope_theta=100000.0,
    ),
}
