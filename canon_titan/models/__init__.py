"""Model code, one folder per family as in TorchTitan's ``models/``: ``llama``, ``llama_canon``,
``gla5``, ``gdn2``, ``mamba2``, each with its modules (``model.py``), its ``[model]`` keys
(``args.py``), its parallelism (``parallelize.py``), its Hugging Face format
(``state_dict_adapter.py``) and its ``FAMILY`` (``family.py``); what they share is in ``common/``.
Importing a family's ``args.py`` imports no model code (``common/deferred.py``)."""
