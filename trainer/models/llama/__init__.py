"""The Llama family (Llama 2 and 3 shapes), registered as `model.family=llama`."""

from trainer.config.schema import ModelConfig
from trainer.models.llama.costs import COSTS
from trainer.models.llama.hf import HF
from trainer.models.llama.model import Llama, check
from trainer.models.llama.parallelize import tp_plan
from trainer.models.spec import ModelSpec, register_family

SPEC = register_family(ModelSpec(family="llama", config=ModelConfig, model=Llama, tp_plan=tp_plan,
                                 costs=COSTS, check=check, hf=HF))
