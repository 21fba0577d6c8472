"""The ``llama_canon`` family as the registry builds it: parallelism, Hugging Face format,
ModelSpec."""

from canon_titan.models.common.family import ModelFamily
from canon_titan.models.llama.parallelize import parallelize_llama
from canon_titan.models.llama.state_dict_adapter import LLAMA_CANON, LlamaStateDictAdapter

FAMILY = ModelFamily(
    name="llama_canon",
    parallelize=parallelize_llama,
    state_dict_adapter=LlamaStateDictAdapter,
    hf_models=(LLAMA_CANON,),
)
