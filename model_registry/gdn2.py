"""``gdn2``: GDN2 (gated DeltaNet) of the PhysicsLM4 linear-model release (spec 5.3, 5.5, 5.7);
canon_set 'AbbCD' for the Canon models, 'bb' for the conv baselines."""

from canon_titan.models.gdn2.args import GDN2Args

__all__ = ["ARGS", "FLAVORS"]

ARGS = GDN2Args

FLAVORS: dict[str, GDN2Args] = {
    # Tiny CPU model: 4 heads (key head 32, value head 64), MLP 2 * dim.
    "debug": GDN2Args(dim=128, n_layers=4, n_heads=4, vocab_size=2048),
    "1B": GDN2Args(dim=2048, n_layers=24, n_heads=16, vocab_size=32000),
    "3B": GDN2Args(dim=3072, n_layers=26, n_heads=24, vocab_size=32000),
    "8B": GDN2Args(dim=4096, n_layers=32, n_heads=32, ffn_hidden_dim=9472, vocab_size=128256),
}
