"""``gdn2``: GDN2 (gated DeltaNet) of the PhysicsLM4 linear-model release (spec 5.3, 5.5, 5.7)."""
