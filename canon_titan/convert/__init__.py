"""Checkpoint conversion between TorchTitan DCP and Hugging Face formats."""
