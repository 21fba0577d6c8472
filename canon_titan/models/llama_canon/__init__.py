"""``llama_canon``: Llama with Canon layers (the release's LlamaCanon); the model, parallelism and
Hugging Face format are the ``llama`` family's, which build Canon layers where the args ask."""

from canon_titan.models.common.family import ModelFamily
from canon_titan.models.llama.parallelize import parallelize_llama
from canon_titan.models.llama.state_dict_adapter import LLAMA_CANON, LlamaStateDictAdapter
from canon_titan.models.llama_canon.args import LlamaCanonArgs

FAMILY = ModelFamily(name="llama_canon", args=LlamaCanonArgs, parallelize=parallelize_llama,
                     state_dict_adapter=LlamaStateDictAdapter, hf_models=(LLAMA_CANON,))
