"""AdamW with bfloat16 moments (optim.state_dtype=bfloat16): a sharded step rounds every element as
one process does, the parity layouts equal the one-process run at the same state precision, and a
checkpoint of that run resumes exactly under another layout."""

import pytest
import torch
from helpers import spawn, train_metrics
from test_parity import CHUNKED, COMMON, GRAD_NORM_RTOL, PLAIN, RTOL, STEPS, check_against
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from trainer.optim.bf16_state import AdamWBF16State

BF16_STATE = ("optim.state_dtype=bfloat16",)
LAYOUTS = {
    # the moments on the host with the weights (what a large model on few GPUs takes)
    "fsdp2_offload": (2, ["+recipe=llama_fsdp", "training.offload=optimizer"]),
    "tp2_pp2": (4, ["+recipe=llama_tp2", "parallel.pp=2", "training.grad_accum_steps=2"]),
}


def _steps(weight: torch.Tensor, grads: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """AdamW with bfloat16 moments over `weight` (a tensor or a DTensor), a step per gradient:
    the weight and the two moments after them, whole."""
    p = torch.nn.Parameter(weight)
    optimizer = AdamWBF16State([{"params": [p], "weight_decay": 0.1}], lr=1e-2, betas=(0.9, 0.999),
                               eps=1e-8)
    for grad in grads:
        p.grad = grad
        optimizer.step()
    state = optimizer.state[p]
    return tuple(getattr(t, "full_tensor", lambda t=t: t)()
                 for t in (p.detach(), state["exp_avg"], state["exp_avg_sq"]))


def _sharded_step_equals_the_whole(rank, world_size):
    mesh = init_device_mesh("cpu", (world_size,))
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(10, 6, generator=g)  # 10 rows on 4 ranks: uneven shards
    grads = [torch.randn(10, 6, generator=g) * (1 + step) for step in range(5)]
    whole = _steps(weight.clone(), [grad.clone() for grad in grads])
    sharded = _steps(distribute_tensor(weight.clone(), mesh, [Shard(0)]),
                     [distribute_tensor(grad, mesh, [Shard(0)]) for grad in grads])
    for name, mine, theirs in zip(("weight", "exp_avg", "exp_avg_sq"), sharded, whole):
        assert torch.equal(mine, theirs), f"{name} of the sharded step differs on rank {rank}"


@pytest.mark.multiprocess
def test_a_sharded_step_rounds_every_element_as_one_process_does():
    """Bitwise: the stochastic rounding's bits are the element's, wherever it is held (a
    generator's draw would differ by layout: 4.6e-6 on the loss, inside the parity rows' 1e-4)."""
    spawn(_sharded_step_equals_the_whole, 4)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The one-process run, saving halfway: (its records, its folder)."""
    out = tmp_path_factory.mktemp("bf16_state")
    records = train_metrics(1, "+recipe=llama_fsdp", *COMMON, *PLAIN, *BF16_STATE,
                            "checkpoint.enabled=true", f"checkpoint.interval={STEPS // 2}",
                            output_dir=out)
    return records, out


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", LAYOUTS)
def test_bf16_state_layout_matches_single_process(layout, reference, tmp_path):
    ranks, overrides = LAYOUTS[layout]
    records = train_metrics(ranks, *overrides, *COMMON, *CHUNKED, *BF16_STATE,
                            output_dir=tmp_path)
    check_against(reference[0], records, f"bf16 state {layout}", RTOL, GRAD_NORM_RTOL)


@pytest.mark.multiprocess
def test_bf16_state_resumes_under_another_layout(reference, tmp_path):
    """The one-process checkpoint of step 2 (its moments in bfloat16), resumed under tp2 with the
    optimizer on the host: steps 3 and 4 are the one-process run's."""
    records, out = reference
    resumed = train_metrics(2, "+recipe=llama_tp2", *COMMON, *CHUNKED, *BF16_STATE,
                            "training.offload=optimizer",
                            f"checkpoint.resume={out / 'checkpoints'}/step_{STEPS // 2}",
                            output_dir=tmp_path)
    assert [r["step"] for r in resumed] == list(range(STEPS // 2 + 1, STEPS + 1))
    for mine, theirs in zip(resumed, records[STEPS // 2:]):
        assert abs(mine["loss"] - theirs["loss"]) <= RTOL * theirs["loss"], (mine, theirs)
