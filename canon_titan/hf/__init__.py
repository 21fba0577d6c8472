"""Hugging Face transformers classes for LlamaCanon.

The two modules here import only torch and transformers: ``canon-titan convert to-hf`` copies
them next to exported weights, so the export loads with ``trust_remote_code=True`` on machines
without canon-titan.
"""
