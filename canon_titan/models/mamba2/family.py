"""The ``mamba2`` family as the registry builds it: parallelism (its kernels tuned before the first
collective), Hugging Face format, ModelSpec."""

from canon_titan.models.common.family import ModelFamily
from canon_titan.models.common.linear_tuning import tuned_first
from canon_titan.models.mamba2.parallelize import parallelize_mamba2
from canon_titan.models.mamba2.state_dict_adapter import Mamba2StateDictAdapter

FAMILY = ModelFamily(
    name="mamba2",
    parallelize=tuned_first(parallelize_mamba2),
    state_dict_adapter=Mamba2StateDictAdapter,
    hf_models=(Mamba2StateDictAdapter.classes,),
)
