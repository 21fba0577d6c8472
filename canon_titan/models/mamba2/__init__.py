"""``mamba2``: Mamba2 of the PhysicsLM4 linear-model release (spec 5.4, 5.5, 5.7)."""
