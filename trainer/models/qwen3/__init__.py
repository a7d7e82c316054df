"""The Qwen3 dense family (Qwen3-0.6B to 32B), registered as `model.family=qwen3`."""

from trainer.models.qwen3.costs import COSTS
from trainer.models.qwen3.hf import HF
from trainer.models.qwen3.model import Qwen3, Qwen3Config, check
from trainer.models.qwen3.parallelize import tp_plan
from trainer.models.spec import ModelSpec, register_family

SPEC = register_family(ModelSpec(family="qwen3", config=Qwen3Config, model=Qwen3, tp_plan=tp_plan,
                                 costs=COSTS, check=check, hf=HF))
