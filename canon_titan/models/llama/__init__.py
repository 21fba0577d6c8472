"""``llama``: the release's Llama baseline (no Canon layers)."""
