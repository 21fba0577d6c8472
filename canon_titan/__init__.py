"""canon-titan: pretraining Canon-augmented language models on TorchTitan."""
