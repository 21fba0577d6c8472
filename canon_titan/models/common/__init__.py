"""What the model families share: Canon layer, norms, RoPE, decoder pieces, parallelism and HF
format helpers."""
