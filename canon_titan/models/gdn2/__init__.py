"""``gdn2``: GDN2 (gated DeltaNet) of the PhysicsLM4 linear-model release (spec 5.3, 5.5, 5.7)."""

from canon_titan.models.common.family import ModelFamily
from canon_titan.models.gdn2.args import GDN2Args
from canon_titan.models.gdn2.parallelize import parallelize_gdn2
from canon_titan.models.gdn2.state_dict_adapter import GDN2StateDictAdapter

FAMILY = ModelFamily(name="gdn2", args=GDN2Args, parallelize=parallelize_gdn2,
                     state_dict_adapter=GDN2StateDictAdapter, hf_models=(GDN2StateDictAdapter.classes,))
