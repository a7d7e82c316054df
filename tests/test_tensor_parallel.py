"""Tensor parallel: where the logits live under loss parallel, and how much of the model each rank holds."""

import pytest
import torch
import torch.nn.functional as F
from helpers import spawn
from torch.distributed.tensor import DTensor, Shard

from trainer import build_model
from trainer.models import count_params, family, init_weights, materialize
from trainer.parallel import ParallelOptions, parallelize
from trainer.parallel.dims import ParallelDims
from trainer.parallel.tensor_parallel import loss_parallel_context
from trainer.steps import cross_entropy


def _tp2_fsdp2(rank, world_size, loss_parallel):
    dims = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=2, pp=1, ep=1, world_size=world_size)
    dims.build_mesh("cpu")
    model = build_model("llama_debug", device="meta")
    parallelize(model, family("llama"), dims, ParallelOptions(loss_parallel=loss_parallel))
    materialize(model, "cpu")
    init_weights(model, seed=0)

    # Every weight is split over all four ranks (dp_shard x tp) but the norms, split over dp only.
    total = count_params(build_model("llama_debug", device="meta"))
    local = sum(p.to_local().numel() for p in model.parameters())
    norms = sum(p.numel() for name, p in model.named_parameters() if name.endswith("norm.weight"))
    assert local == (total - norms) // 4 + norms // 2

    seen = []
    model.output.register_forward_hook(lambda module, args, output: seen.append(output))
    tokens = torch.randint(0, 2048, (2, 17), generator=torch.Generator().manual_seed(dims.view("dp").get_local_rank()))
    with loss_parallel_context(loss_parallel):
        loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
    (logits,) = seen
    if loss_parallel:
        # Split on the vocabulary: no rank ever holds a whole row of logits.
        assert isinstance(logits, DTensor) and logits.placements == (Shard(2),)
        assert logits.to_local().shape == (2, 16, 2048 // 2)
    else:
        assert not isinstance(logits, DTensor) and logits.shape == (2, 16, 2048)
    # The loss is the ordinary cross-entropy of the whole logits.
    with torch.no_grad():
        full = logits.full_tensor() if isinstance(logits, DTensor) else logits
        expected = F.cross_entropy(full.flatten(0, 1), tokens[:, 1:].flatten())
        value = loss.full_tensor() if isinstance(loss, DTensor) else loss
    torch.testing.assert_close(value, expected)


@pytest.mark.multiprocess
def test_loss_parallel_keeps_logits_split_on_the_vocabulary():
    spawn(_tp2_fsdp2, 4, True)


@pytest.mark.multiprocess
def test_without_loss_parallel_logits_are_whole():
    spawn(_tp2_fsdp2, 4, False)
