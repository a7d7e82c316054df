"""The Mixtral family, registered as `model.family=mixtral`. Expert parallel applies to its MoE
layers wherever they are (trainer/parallel/expert_parallel.py finds them by type)."""

from trainer.models.decoder import moe_block_regions
from trainer.models.mixtral.costs import COSTS
from trainer.models.mixtral.hf import HF
from trainer.models.mixtral.model import Mixtral, MixtralConfig, check
from trainer.models.mixtral.parallelize import tp_plan
from trainer.models.spec import ModelSpec, register_family

SPEC = register_family(ModelSpec(family="mixtral", config=MixtralConfig, model=Mixtral,
                                 tp_plan=tp_plan, costs=COSTS, check=check, hf=HF,
                                 checkpoint_regions=moe_block_regions))
