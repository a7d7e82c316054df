"""AdamW with bfloat16 moments (optim.state_dtype=bfloat16) and with blockwise 8-bit ones (float8):
a sharded step rounds every element as one process does, the parity layouts equal the one-process
run at the same state precision, and a checkpoint of that run resumes exactly under another
layout."""

import pytest
import torch
from helpers import spawn, train_metrics
from test_parity import CHUNKED, COMMON, GRAD_NORM_RTOL, PLAIN, RTOL, STEPS, check_against
from test_plan import job_of
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from trainer.checks.job import check_job
from trainer.errors import ConfigError
from trainer.optim.bf16_state import AdamWBF16State
from trainer.optim.f8_state import AdamWF8State, warmup_note

STATES = {"bfloat16": ("optim.state_dtype=bfloat16",), "float8": ("optim.state_dtype=float8",)}
# (state precision, layout) -> (ranks, recipe and overrides)
LAYOUTS = {
    # the moments on the host with the weights (what a large model on few GPUs takes)
    ("bfloat16", "fsdp2_offload"): (2, ["+recipe=llama_fsdp", "training.offload=optimizer"]),
    # float8's blocks under tp's column shards (the rowwise layers), with pp and accumulation
    ("float8", "tp2_pp2"): (4, ["+recipe=llama_tp2", "parallel.pp=2",
                                "training.grad_accum_steps=2"]),
}
# The one-process checkpoint of step 2 resumed under another layout, the optimizer on the host:
# state -> (ranks, overrides). With the rows above, each precision runs under FSDP, tp and pp.
RESUMES = {"bfloat16": (4, ["+recipe=llama_tp2", "parallel.pp=2", "training.offload=optimizer"]),
           "float8": (2, ["+recipe=llama_fsdp", "training.offload=optimizer"])}


def _steps(cls: type, weight: torch.Tensor, grads: list[torch.Tensor]) -> dict:
    """AdamW of `cls` over `weight` (a tensor or a DTensor), a step per gradient: the weight and
    every state tensor after them, whole."""
    p = torch.nn.Parameter(weight)
    optimizer = cls([{"params": [p], "weight_decay": 0.1}], lr=1e-2, betas=(0.9, 0.999), eps=1e-8)
    for grad in grads:
        p.grad = grad
        optimizer.step()
    held = {"weight": p.detach(), **optimizer.state[p]}
    return {k: getattr(t, "full_tensor", lambda t=t: t)() for k, t in held.items()}


def _sharded_step_equals_the_whole(rank, world_size):
    g = torch.Generator().manual_seed(0)
    # 10 rows on 4 ranks: uneven shards; 64 columns on 2: two blocks of float8's 32 on each
    weight = torch.randn(10, 64, generator=g)
    grads = [torch.randn(10, 64, generator=g) * (1 + step) for step in range(5)]
    meshes = [(init_device_mesh("cpu", (world_size,)), [Shard(0)]),
              (init_device_mesh("cpu", (2, world_size // 2)), [Shard(1), Shard(0)])]
    for cls in (AdamWBF16State, AdamWF8State):
        whole = _steps(cls, weight.clone(), [grad.clone() for grad in grads])
        for mesh, placements in meshes:
            sharded = _steps(cls, distribute_tensor(weight.clone(), mesh, placements),
                             [distribute_tensor(grad, mesh, placements) for grad in grads])
            assert sharded.keys() == whole.keys()
            for name, mine in sharded.items():
                assert torch.equal(mine, whole[name]), (
                    f"{cls.__name__}'s {name} of the step sharded {placements} differs on rank "
                    f"{rank}")


def test_float8_state_with_a_short_warmup_says_so_at_start_up():
    """The README's smoke (2 warmup steps at lr 1e-3) spikes with float8 moments (docs/memory.md):
    a run with fewer than ten warmup steps is told, the recipes' 200 are not."""
    note = warmup_note("float8", 2)
    assert note.startswith("note: optim.state_dtype=float8 with training.warmup_steps=2: ")
    assert "warm up for 10 steps or more" in note
    assert warmup_note("float8", 10) is None and warmup_note("bfloat16", 2) is None


@pytest.mark.multiprocess
def test_a_sharded_step_rounds_every_element_as_one_process_does():
    """Bitwise, for both state precisions, rows sharded unevenly and columns cut on float8's block
    grid: the stochastic rounding's bits are the element's, wherever it is held (a generator's
    draw would differ by layout: 4.6e-6 on the loss, inside the parity rows' 1e-4)."""
    spawn(_sharded_step_equals_the_whole, 4)


def test_a_layout_cutting_float8_s_blocks_is_refused_before_launch():
    """tp=2 cuts llama_debug's feed-forward output layer (rowwise, 96 inputs) into 48: off the grid
    of 32; 128 (64 a rank) is on it."""
    cut = job_of("+recipe=llama_tp2", "model=llama_debug", "+smoke=cpu", "model.ffn_dim=96",
                 *STATES["float8"])
    with pytest.raises(ConfigError, match=r"^optim.state_dtype=float8 holds blocks of 32 elements "
                                          r"of a row; this layout cuts a parameter's last "
                                          r"dimension 96 into 48: choose a parallel.tp"):
        check_job(cut, 2)
    check_job(job_of("+recipe=llama_tp2", "model=llama_debug", "+smoke=cpu", "model.ffn_dim=128",
                     *STATES["float8"]), 2)


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """The one-process run at a state precision, saving halfway: precision -> (its records, its
    folder), each run once."""
    runs = {}

    def reference(state: str):
        if state not in runs:
            out = tmp_path_factory.mktemp(f"{state}_state")
            records = train_metrics(1, "+recipe=llama_fsdp", *COMMON, *PLAIN, *STATES[state],
                                    "checkpoint.enabled=true", f"checkpoint.interval={STEPS // 2}",
                                    output_dir=out)
            runs[state] = records, out
        return runs[state]
    return reference


@pytest.mark.multiprocess
@pytest.mark.parametrize("state,layout", LAYOUTS)
def test_a_state_precision_s_layout_matches_single_process(state, layout, references, tmp_path):
    ranks, overrides = LAYOUTS[state, layout]
    records = train_metrics(ranks, *overrides, *COMMON, *CHUNKED, *STATES[state],
                            output_dir=tmp_path)
    check_against(references(state)[0], records, f"{state} state {layout}", RTOL, GRAD_NORM_RTOL)


@pytest.mark.multiprocess
@pytest.mark.parametrize("state", RESUMES)
def test_a_state_precision_s_checkpoint_resumes_under_another_layout(state, references, tmp_path):
    """The one-process checkpoint of step 2 (its moments in that precision), resumed under another
    layout with the optimizer on the host: steps 3 and 4 are the one-process run's."""
    records, out = references(state)
    ranks, overrides = RESUMES[state]
    resumed = train_metrics(ranks, *overrides, *COMMON, *CHUNKED, *STATES[state],
                            f"checkpoint.resume={out / 'checkpoints'}/step_{STEPS // 2}",
                            output_dir=tmp_path)
    assert [r["step"] for r in resumed] == list(range(STEPS // 2 + 1, STEPS + 1))
    for mine, theirs in zip(resumed, records[STEPS // 2:]):
        assert abs(mine["loss"] - theirs["loss"]) <= RTOL * theirs["loss"], (mine, theirs)
