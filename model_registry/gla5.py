"""``gla5``: GLA5 of the PhysicsLM4 linear-model release (spec 5.2, 5.5, 5.7); canon_set 'AbbCD'
for the Canon models, 'bb' for the conv baselines."""

from canon_titan.models.gla5.args import GLA5Args

__all__ = ["ARGS", "FLAVORS"]

ARGS = GLA5Args

FLAVORS: dict[str, GLA5Args] = {
    # Tiny CPU model: 4 heads (key head 32, value head 64), MLP 2 * dim.
    "debug": GLA5Args(dim=128, n_layers=4, n_heads=4, vocab_size=2048),
    "1B": GLA5Args(dim=2048, n_layers=24, n_heads=16, vocab_size=32000),
    "3B": GLA5Args(dim=3072, n_layers=26, n_heads=24, vocab_size=32000),
    "8B": GLA5Args(dim=4096, n_layers=32, n_heads=32, ffn_hidden_dim=9472, vocab_size=128256),
}
