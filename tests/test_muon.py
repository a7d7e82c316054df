"""Muon: the Newton-Schulz iteration, the update's scale, skipped steps, one process against
torch.optim.Muon, and the exchange that orthogonalises sharded matrices whole (its parity rows in
every layout: tests/test_parity.py)."""

import math

import pytest
import torch
import torch.distributed as dist
from helpers import spawn
from torch import nn

from trainer.models import build_model, family
from trainer.optim.build import build_optimizer
from trainer.optim.muon import MuonConfig, orthogonalize


def matrix(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))


# Gaussian matrices of one side three times the other: their singular values spread over a factor
# of 3.7, which 5 steps bring into the band (a square Gaussian matrix has singular values near 0,
# which any 5-step iteration leaves small).
SHAPES = [(32, 96), (96, 32), (64, 192), (8, 4, 12)]
BAND = (0.65, 1.2)  # measured: [0.682, 1.134] in float32, [0.677, 1.141] in bfloat16


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_newton_schulz_brings_singular_values_into_the_band(shape, dtype):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    out = orthogonalize(x, 5, dtype).double()
    singular = torch.linalg.svdvals(out)
    assert BAND[0] <= singular.min() and singular.max() <= BAND[1], singular
    # The singular vectors stay x's (the iteration is a polynomial in x x^T applied to x): in x's
    # singular bases the output is diagonal.
    u, _, vh = torch.linalg.svd(x.double(), full_matrices=False)
    inner = u.mT @ out @ vh.mT
    off = inner - torch.diag_embed(torch.diagonal(inner, dim1=-2, dim2=-1))
    assert off.abs().max() <= (1e-5 if dtype == torch.float32 else 3e-2)


def test_bfloat16_iteration_matches_torch_optim_muon():
    from torch.optim._muon import _zeropower_via_newtonschulz  # the reference's own function

    for rows, cols in [(32, 96), (96, 32)]:
        x = matrix(rows, cols)
        ours = orthogonalize(x, 5, torch.bfloat16)
        theirs = _zeropower_via_newtonschulz(x, (3.4445, -4.7750, 2.0315), 5, 1e-7).float()
        assert (ours - theirs).abs().max() <= 0.02 * theirs.abs().max()


def block_model(*shapes: tuple[int, int]) -> nn.Module:
    """A model whose `layers.0` holds a Linear of each (out, in) shape, plus an embedding."""
    model = nn.Module()
    model.tok_embeddings = nn.Embedding(16, 8)
    model.layers = nn.ModuleDict({"0": nn.Sequential(*(nn.Linear(i, o, bias=False)
                                                       for o, i in shapes))})
    return model


def muon_optimizer(model: nn.Module, lr: float, weight_decay: float = 0.0,
                   **keys) -> torch.optim.Optimizer:
    optim = MuonConfig(name="muon", ns_dtype="float32", **keys)
    return build_optimizer(model, optim, lr, weight_decay, family("llama"))


@pytest.mark.parametrize("shape", [(32, 96), (96, 32), (64, 192), (48, 48)])
def test_update_rms_follows_the_rule(shape):
    """match_rms_adamw: 0.2 x sqrt(max(rows, cols)) times the orthogonalised update, whose RMS is
    sqrt(mean s^2 / max(rows, cols)): the update's RMS is 0.2 x the singular values' RMS, whatever
    the shape (a square Gaussian matrix's small singular values pull it lower)."""
    model = block_model(shape)
    weight = model.layers["0"][0].weight
    before = weight.detach().clone()
    weight.grad = matrix(*shape, seed=2)
    muon_optimizer(model, lr=1.0).step()
    rms = (weight.detach() - before).pow(2).mean().sqrt().item()
    singular = torch.linalg.svdvals(orthogonalize(matrix(*shape, seed=2), 5))
    assert rms == pytest.approx(0.2 * singular.pow(2).mean().sqrt().item(), rel=1e-4)
    assert 0.13 <= rms <= 0.22


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
def test_skipped_step_leaves_weights_and_momentum(state_dtype):
    model = block_model((8, 12))
    optimizer = muon_optimizer(model, lr=0.1, weight_decay=0.1, state_dtype=state_dtype)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    state = {k: [t.clone() for t in v.values()] for k, v in optimizer.state.items()}
    weights = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.full_like(p, math.nan)
    optimizer.found_inf = torch.ones(())
    optimizer.step()
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
    assert all(torch.equal(a, b) for p, saved in state.items()
               for a, b in zip(optimizer.state[p].values(), saved))
    low = [t.dtype for s in optimizer.state.values() for k, t in s.items() if k != "step"]
    assert set(low) == {torch.float32 if state_dtype == "float32" else torch.bfloat16}, low


def test_one_process_matches_torch_muon_and_adamw():
    """Ours (Newton-Schulz in bfloat16, as torch's) against torch.optim.Muon on the block matrices
    and torch.optim.AdamW on the rest, over a few steps of a real model's parameters."""
    lr, wd, steps = 0.02, 0.1, 3
    config = {"family": "llama", "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
              "vocab_size": 128, "ffn_dim": 192}
    start, ours_model, torch_model = (build_model(config) for _ in range(3))
    optim = MuonConfig(name="muon", ns_dtype="bfloat16")
    ours = build_optimizer(ours_model, optim, lr, wd, family("llama"))
    matrices = [p for name, p in torch_model.named_parameters() if name.startswith("layers.")
                and p.ndim == 2]
    rest = [p for p in torch_model.parameters() if all(p is not m for m in matrices)]
    theirs = [torch.optim.Muon(matrices, lr=lr, weight_decay=wd, adjust_lr_fn="match_rms_adamw"),
              torch.optim.AdamW([{"params": [p for p in rest if p.ndim >= 2], "weight_decay": wd},
                                 {"params": [p for p in rest if p.ndim < 2], "weight_decay": 0.0}],
                                lr=lr, betas=(0.9, 0.95), eps=1e-8)]
    generator = torch.Generator().manual_seed(3)
    for _ in range(steps):
        for a, b in zip(ours_model.parameters(), torch_model.parameters()):
            a.grad = torch.randn(a.shape, generator=generator)
            b.grad = a.grad.clone()
        ours.step()
        for optimizer in theirs:
            optimizer.step()
    for (name, a), b in zip(ours_model.named_parameters(), torch_model.parameters()):
        moved = (b - start.get_parameter(name)).abs().max()
        assert (a - b).abs().max() <= 0.02 * moved, name


def test_routers_norms_and_embeddings_take_adamw():
    model = build_model("mixtral_debug", device="meta")
    optimizer = muon_optimizer(model, lr=1e-3)
    names = {id(p): name for name, p in model.named_parameters()}
    muon = {names[id(p)] for p in optimizer.param_groups[0]["params"]}
    assert "layers.0.feed_forward.experts.w1" in muon and "layers.0.attention.wq.weight" in muon
    assert not any("router" in n or "norm" in n or "tok_embeddings" in n or "output" in n
                   for n in muon)
    assert not any(group["muon"] for group in optimizer.param_groups[1:])


def _exchange(rank: int, world_size: int) -> None:
    """FSDP (2) over tensor parallel (2), and 1-D shardings of stacked experts, against each matrix
    orthogonalised whole on one process."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    import trainer.optim.muon_exchange
    from trainer.optim.muon_exchange import MatrixExchange, my_box

    trainer.optim.muon_exchange.ROUND_ELEMENTS = 500  # several rounds (the parity rows run one)

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(24, 40, bias=False), nn.Linear(40, 24, bias=False))
    whole = [p.detach().clone() for p in block.parameters()]
    parallelize_module(block, mesh["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel()})
    fully_shard(block, mesh=mesh["dp"])
    params = list(block.parameters())
    flat = init_device_mesh("cpu", (4,))
    # Experts split inside each matrix (dim 1, 10 rows over 4 ranks: 3, 3, 3, 1), and whole (dim 0).
    for shape, dim in [((3, 10, 6), 1), ((8, 5, 7), 0), ((3, 6), 0)]:
        full = torch.randn(shape, generator=torch.Generator().manual_seed(len(whole)))
        whole.append(full)
        params.append(distribute_tensor(full, flat, [Shard(dim)]))
    # Every parameter here is split over all four ranks.
    exchange = MatrixExchange(params, 5,
                              lambda ranks: dist.group.WORLD if len(ranks) == 4 else None)
    updates = [p.to_local().clone() for p in params]
    results = [torch.full_like(u, math.nan) for u in updates]
    exchange.orthogonalize(updates, lambda m: orthogonalize(m, 5), results)
    for p, full, result in zip(params, whole, results):
        offset, shape = my_box(p)
        expected = orthogonalize(full, 5)[tuple(slice(o, o + s) for o, s in zip(offset, shape))]
        torch.testing.assert_close(result, expected, rtol=1e-5, atol=1e-6)
    assert len(exchange.parts[0][1].rounds) > 1
    # Each rank does a share: 2 + 3 + 1 split matrices and 8 whole experts (2 a rank).
    counts = [None] * world_size
    dist.all_gather_object(counts, exchange.matrices_here())
    assert sum(counts) == 2 + 3 + 8 + 1 and max(counts) - min(counts) <= 2, counts


@pytest.mark.multiprocess
def test_sharded_matrices_are_orthogonalised_whole():
    spawn(_exchange, 4, timeout=120)
