"""``mamba2``: Mamba2 of the PhysicsLM4 linear-model release (spec 5.4, 5.5, 5.7)."""

from canon_titan.models.common.family import ModelFamily
from canon_titan.models.mamba2.args import Mamba2Args
from canon_titan.models.mamba2.parallelize import parallelize_mamba2
from canon_titan.models.mamba2.state_dict_adapter import Mamba2StateDictAdapter

FAMILY = ModelFamily(name="mamba2", args=Mamba2Args, parallelize=parallelize_mamba2,
                     state_dict_adapter=Mamba2StateDictAdapter, hf_models=(Mamba2StateDictAdapter.classes,))
