"""An optimizer defined here, not under trainer/: Lion (Chen et al. 2023, "Symbolic Discovery of
Optimization Algorithms"), registered through the public registry with a config key of its own
(optim.lr_scale) and a rule on it, one fp32 state a parameter element. The ranks import this module
through the config's `imports`, where the optimizer registers itself. It trains under FSDP2 as the
plan counts it; and the plan counts each optimizer's state as it holds it."""

from dataclasses import dataclass

import pytest
import torch
from helpers import train_metrics
from test_plan import LLAMA, MEMORY_RTOL, ONE_THREAD, SIZE, job_of

from trainer.checks.job import check_job
from trainer.checks.overrides import compose_job
from trainer.config.schema import OptimConfig
from trainer.errors import ConfigError
from trainer.models import build_model, family
from trainer.optim.build import build_optimizer
from trainer.optim.spec import OptimizerInputs, OptimizerSpec, register_optimizer
from trainer.plan import GIB, make_plan
from trainer.plan.devices import local_device
from trainer.tensors import local_tensor


@dataclass
class LionConfig(OptimConfig):
    # Lion's updates are signs, each of size lr: its learning
    # rate is AdamW's times this (the paper: 3-10x smaller).
    lr_scale: float = 0.3


def check(cfg: LionConfig) -> None:
    if not 0 < cfg.lr_scale <= 1:
        raise ConfigError(f"optim.lr_scale={cfg.lr_scale} must be in (0, 1]")


class Lion(torch.optim.Optimizer):
    """The update is the sign of beta1's blend of momentum and gradient; the momentum follows the
    gradient at beta2. Element by element, so it works on each rank's shard; a step the trainer
    skips (`found_inf`, a device tensor) leaves weights and momentum as they were."""

    def __init__(self, groups: list[dict], lr: float, betas: tuple[float, float]):
        super().__init__(groups, dict(lr=lr, betas=betas, weight_decay=0.0))

    @torch.no_grad()
    def step(self, closure=None):
        skip = getattr(self, "found_inf", None)
        keep = 1.0 if skip is None else 1 - skip
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if not self.state[p]:
                    self.state[p]["exp_avg"] = torch.zeros_like(p)
                weight, grad = local_tensor(p), local_tensor(p.grad)
                momentum = local_tensor(self.state[p]["exp_avg"])
                update = momentum.mul(beta1).add_(grad, alpha=1 - beta1).sign_()
                weight.mul_(1 - group["lr"] * group["weight_decay"] * keep)
                weight.add_(update * (-group["lr"] * keep))
                momentum.lerp_(grad, (1 - beta2) * keep)


def build(inputs: OptimizerInputs) -> Lion:
    cfg = inputs.cfg
    return Lion(inputs.groups, lr=inputs.lr * cfg.lr_scale, betas=(cfg.beta1, cfg.beta2))


LION = register_optimizer(OptimizerSpec(name="lion", build=build, config=LionConfig, check=check,
                                        state_words=1.0))
OURS = ("imports=[test_optimizer]", "optim.name=lion")


def test_its_config_is_typed_by_its_class_and_checked_by_its_rules():
    job = compose_job([*OURS, "optim.lr_scale=0.5"])
    assert isinstance(job.optim, LionConfig) and job.optim.lr_scale == 0.5
    with pytest.raises(ConfigError, match=r"^optim.lr_scale=2.0 must be in \(0, 1\]$"):
        check_job(compose_job([*OURS, "optim.lr_scale=2", "model=llama_debug"]), 1)
    with pytest.raises(ConfigError,
                       match=r"^optim.lr_scale is not a config key \(of optim.name=adamw\); it is "
                             r"optim=lion's$"):
        compose_job(["imports=[test_optimizer]", "optim.lr_scale=0.5"])


@pytest.mark.parametrize("optim", [("optim=adamw",), ("optim.state_dtype=bfloat16",),
                                   ("optim.state_dtype=float8",), ("optim=muon",),
                                   ("optim=muon", "optim.state_dtype=bfloat16"), OURS])
def test_the_plan_counts_each_optimizer_s_state_as_it_holds(optim):
    """One rank: the plan's optimizer term against the bytes of every state tensor after a step
    (AdamW's two moments, in fp32, bfloat16 or float8 blocks, and step counts; Muon's momentum for
    its matrices, AdamW's for the rest; Lion's one momentum). The plan counts float8's blocks
    for every element: the norm weights' fp32 moments are 0.2% more."""
    job = job_of("model=llama_debug", *optim)
    model = build_model(job.model)
    optimizer = build_optimizer(model, job.optim, 1e-3, 0.1, family(job.model.family))
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    held = sum(t.numel() * t.element_size() for state in optimizer.state.values()
               for t in state.values()
               if isinstance(t, torch.Tensor) and t.ndim > 0)
    plan = make_plan(job, check_job(job, 1), local_device(torch.device("cpu"), 1))
    planned = plan.ranks[0].optimizer
    assert planned == pytest.approx(held, rel=0.003 if "float8" in optim[0] else 0), (
        optim, planned, held)


@pytest.mark.multiprocess
def test_an_optimizer_of_its_own_trains_under_fsdp2_in_the_memory_the_plan_predicts(tmp_path):
    overrides = ("+recipe=llama_fsdp", *LLAMA, *SIZE, *OURS, "training.steps=2")
    records = train_metrics(2, *overrides, output_dir=tmp_path, timeout=300, env=ONE_THREAD)
    assert records[-1]["loss"] < records[0]["loss"], records
    job = job_of(*overrides)
    plan = make_plan(job, check_job(job, 2), local_device(torch.device("cpu"), 2))
    measured, predicted = records[-1]["mem_tensor_gib"], plan.ranks[0].peak / GIB
    print(f"lion on fsdp2: measured {measured:.3f} GiB, plan {predicted:.3f} "
          f"({predicted / measured - 1:+.1%})")
    assert abs(predicted / measured - 1) <= MEMORY_RTOL, (measured, predicted)
