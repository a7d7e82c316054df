"""The DeepSeek-V3 family (DeepSeek-V3, Kimi K2, DeepSeek-V2-Lite's shape), registered as
`model.family=deepseek_v3`; expert parallel applies to its MoE blocks as to any MoE family's."""

from trainer.models.decoder import moe_block_regions
from trainer.models.deepseek_v3.costs import DeepseekV3Costs
from trainer.models.deepseek_v3.hf import HF
from trainer.models.deepseek_v3.model import DeepseekV3, DeepseekV3Config, block_kind, check
from trainer.models.deepseek_v3.parallelize import tp_divides, tp_plan
from trainer.models.spec import ModelSpec, register_family

SPEC = register_family(ModelSpec(family="deepseek_v3", config=DeepseekV3Config, model=DeepseekV3,
                                 tp_plan=tp_plan, costs=DeepseekV3Costs(), check=check, hf=HF,
                                 tp_divides=tp_divides, block_kind=block_kind,
                                 checkpoint_regions=moe_block_regions))
