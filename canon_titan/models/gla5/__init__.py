"""``gla5``: GLA5 of the PhysicsLM4 linear-model release (spec 5.2, 5.5, 5.7)."""

from canon_titan.models.common.family import ModelFamily
from canon_titan.models.gla5.args import GLA5Args
from canon_titan.models.gla5.parallelize import parallelize_gla5
from canon_titan.models.gla5.state_dict_adapter import GLA5StateDictAdapter

FAMILY = ModelFamily(name="gla5", args=GLA5Args, parallelize=parallelize_gla5,
                     state_dict_adapter=GLA5StateDictAdapter, hf_models=(GLA5StateDictAdapter.classes,))
