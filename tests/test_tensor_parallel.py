"""Tensor parallel: the output head and its loss split on the vocabulary (or not), and how much of
the model each rank holds."""

import pytest
import torch
from helpers import spawn
from reference import cross_entropy
from torch.distributed.tensor import DTensor

from trainer import build_model
from trainer.models import count_params, family, init_weights, materialize
from trainer.models.head import IGNORE_INDEX, set_loss_chunk
from trainer.parallel import ParallelOptions, parallelize
from trainer.parallel.dims import ParallelDims


def _tp2_fsdp2(rank, world_size, loss_parallel):
    dims = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=2, pp=1, ep=1, world_size=world_size)
    dims.build_mesh("cpu")
    model = build_model("llama_debug", device="meta")
    parallelize(model, family("llama"), dims, ParallelOptions(loss_parallel=loss_parallel),
                model.config)
    materialize(model, "cpu")
    init_weights(model, seed=0)
    set_loss_chunk(model, 5)  # 32 tokens: six chunks and a short one

    # Every weight is split over all four ranks (dp_shard x tp) but the norms, split over dp only,
    # and without loss parallel the output head, replicated on the tp ranks.
    total = count_params(build_model("llama_debug", device="meta"))
    local = sum(p.to_local().numel() for p in model.parameters())
    on_dp = ("norm.weight",) if loss_parallel else ("norm.weight", "output.weight")
    dp_only = sum(p.numel() for name, p in model.named_parameters() if name.endswith(on_dp))
    assert local == (total - dp_only) // 4 + dp_only // 2

    # The same tokens on every rank (FSDP's average of
    # equal gradients is that gradient), one label ignored.
    tokens = torch.randint(0, 2048, (2, 17), generator=torch.Generator().manual_seed(0))
    labels = tokens[:, 1:].clone()
    labels[1, 4] = IGNORE_INDEX
    seen = []
    model.output.register_forward_hook(lambda module, args, output: seen.append(output))
    loss = model(tokens[:, :-1], labels=labels)
    loss.backward()
    # Only the loss leaves the head: no logits of the whole microbatch, split or not.
    assert seen[0].dim() == 0

    # The loss and the gradients are those of the plain cross-entropy on one process.
    reference = build_model("llama_debug", device="meta")
    materialize(reference, "cpu")
    init_weights(reference, seed=0)
    expected = cross_entropy(reference(tokens[:, :-1]), labels)
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
    for name in ("output.weight", "tok_embeddings.weight", "layers.0.attention.wq.weight"):
        grad, plain = (model.get_parameter(name).grad.full_tensor(),
                       reference.get_parameter(name).grad)
        assert (grad - plain).norm() <= 1e-6 * plain.norm(), name
    # asked for logits, a rank gives its vocabulary shard (loss parallel) or all
    with torch.no_grad():
        logits = model(tokens[:, :-1])
    assert logits.shape == (2, 16, 2048 // 2 if loss_parallel else 2048)
    assert not isinstance(logits, DTensor)


@pytest.mark.multiprocess
def test_loss_parallel_splits_the_head_on_the_vocabulary_and_equals_the_plain_loss():
    spawn(_tp2_fsdp2, 4, True)


@pytest.mark.multiprocess
def test_without_loss_parallel_every_rank_computes_the_whole_loss():
    spawn(_tp2_fsdp2, 4, False)
