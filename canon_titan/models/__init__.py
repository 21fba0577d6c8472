"""Model code, one folder per family as in TorchTitan's ``models/``: ``llama``, ``llama_canon``,
``gla5``, ``gdn2``, ``mamba2``, each with its modules (``model.py``), its ``[model]`` keys
(``args.py``), its parallelism (``parallelize.py``), its Hugging Face format
(``state_dict_adapter.py``) and its ``FAMILY``; what they share is in ``common/``."""
