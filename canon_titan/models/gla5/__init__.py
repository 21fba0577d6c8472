"""``gla5``: GLA5 of the PhysicsLM4 linear-model release (spec 5.2, 5.5, 5.7)."""
