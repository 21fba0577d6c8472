"""``llama_canon``: LlamaCanon of the PhysicsLM4 release (Canon-ABCD, partial RoPE; spec 1-4)."""

from canon_titan.models.llama_canon.args import LlamaCanonArgs

__all__ = ["ARGS", "FLAVORS"]

ARGS = LlamaCanonArgs

FLAVORS: dict[str, LlamaCanonArgs] = {
    # Tiny CPU model; head_dim 32 with RoPE on a quarter of it, as the released models do.
    "debug": LlamaCanonArgs(
        dim=128,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        ffn_hidden_dim=384,
        vocab_size=2048,
        qk_norm=True,
        z_loss=True,
        rope_dim=8,
        max_seq_len=256,
    ),
    "1B": LlamaCanonArgs(
        dim=2048, n_layers=24, n_heads=32, vocab_size=32000, qk_norm=True, z_loss=True, rope_dim=16
    ),
    "3B": LlamaCanonArgs(
        dim=3072, n_layers=26, n_heads=24, vocab_size=32000, qk_norm=True, z_loss=True, rope_dim=32
    ),
    "8B": LlamaCanonArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_hidden_dim=14336,
        vocab_size=128256,
        rope_theta=100000.0,
        rope_dim=32,
    ),
}
