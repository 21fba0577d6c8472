"""Synthetic pretraining tasks of Physics of Language Models Part 4.1 (Depo, Brevo, ...).

Generators are plain Python (no torch), deterministic from (seed, rank, index), and emit token
ids directly, in the reference generators' layouts, with per-token labels (1 = answer token).
"""
