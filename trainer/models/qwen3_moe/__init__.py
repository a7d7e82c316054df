"""The Qwen3-MoE family (Qwen3-30B-A3B, Qwen3-235B-A22B), registered as `model.family=qwen3_moe`;
expert parallel as for Mixtral."""

from trainer.models.decoder import moe_block_regions
from trainer.models.qwen3_moe.costs import COSTS
from trainer.models.qwen3_moe.hf import HF
from trainer.models.qwen3_moe.model import Qwen3Moe, Qwen3MoeConfig, check
from trainer.models.qwen3_moe.parallelize import tp_plan
from trainer.models.spec import ModelSpec, register_family

SPEC = register_family(ModelSpec(family="qwen3_moe", config=Qwen3MoeConfig, model=Qwen3Moe,
                                 tp_plan=tp_plan, costs=COSTS, check=check, hf=HF,
                                 checkpoint_regions=moe_block_regions))
