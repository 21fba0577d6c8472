"""``llama``: the release's Llama baseline (no Canon layers)."""

from canon_titan.models.common.family import ModelFamily
from canon_titan.models.llama.args import LlamaArgs
from canon_titan.models.llama.parallelize import parallelize_llama
from canon_titan.models.llama.state_dict_adapter import LLAMA_CANON, LlamaStateDictAdapter

FAMILY = ModelFamily(name="llama", args=LlamaArgs, parallelize=parallelize_llama,
                     state_dict_adapter=LlamaStateDictAdapter, hf_models=(LLAMA_CANON,))
