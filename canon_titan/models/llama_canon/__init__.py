"""``llama_canon``: Llama with Canon layers (the release's LlamaCanon); the model, parallelism and
Hugging Face format are the ``llama`` family's, which build Canon layers where the args ask."""
