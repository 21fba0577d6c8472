"""The ``gdn2`` family as the registry builds it: parallelism (its kernels tuned before the first
collective), Hugging Face format, ModelSpec."""

from canon_titan.models.common.family import ModelFamily
from canon_titan.models.common.linear_tuning import tuned_first
from canon_titan.models.gdn2.parallelize import parallelize_gdn2
from canon_titan.models.gdn2.state_dict_adapter import GDN2StateDictAdapter

FAMILY = ModelFamily(
    name="gdn2",
    parallelize=tuned_first(parallelize_gdn2),
    state_dict_adapter=GDN2StateDictAdapter,
    hf_models=(GDN2StateDictAdapter.classes,),
)
