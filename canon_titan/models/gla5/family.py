"""The ``gla5`` family as the registry builds it: parallelism (its kernels tuned before the first
collective), Hugging Face format, ModelSpec."""

from canon_titan.models.common.family import ModelFamily
from canon_titan.models.common.linear_tuning import tuned_first
from canon_titan.models.gla5.parallelize import parallelize_gla5
from canon_titan.models.gla5.state_dict_adapter import GLA5StateDictAdapter

FAMILY = ModelFamily(
    name="gla5",
    parallelize=tuned_first(parallelize_gla5),
    state_dict_adapter=GLA5StateDictAdapter,
    hf_models=(GLA5StateDictAdapter.classes,),
)
