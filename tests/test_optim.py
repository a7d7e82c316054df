"""Learning-rate schedule, weight-decay groups, clipping and AdamW with bfloat16 moments."""

import math

import torch

from trainer.config.schema import OptimConfig
from trainer.optim import bf16_state
from trainer.optim.bf16_state import AdamWBF16State, round_stochastic
from trainer.optim.build import build_optimizer
from trainer.optim.clipping import clip_grad_norm_
from trainer.optim.schedule import lr_lambda


def test_warmup_then_cosine_to_the_floor():
    factor = lr_lambda(warmup_steps=4, total_steps=20, min_ratio=0.1)
    assert [factor(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert math.isclose(factor(12), 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert math.isclose(factor(20), 0.1) and math.isclose(factor(25), 0.1)


def test_norm_weights_are_not_decayed():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False), torch.nn.RMSNorm(4))
    decayed, plain = build_optimizer(model, OptimConfig(), lr=1e-3, weight_decay=0.1).param_groups
    assert [p.ndim for p in decayed["params"]] == [2] and decayed["weight_decay"] == 0.1
    assert [p.ndim for p in plain["params"]] == [1] and plain["weight_decay"] == 0.0


def test_clipping_matches_torch():
    torch.manual_seed(0)
    a, b = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(2)]
    c, d = [torch.nn.Parameter(x.detach().clone()) for x in (a, b)]
    for p, scale in ((a, 2.0), (b, -6.0), (c, 2.0), (d, -6.0)):
        p.grad = torch.full_like(p, scale)
    ours = clip_grad_norm_([a, b], max_norm=1.0)
    theirs = torch.nn.utils.clip_grad_norm_([c, d], max_norm=1.0)
    torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(a.grad, c.grad)


def test_stochastic_rounding_is_unbiased_and_keyed_by_value_and_step():
    # an eighth of a bfloat16 step above 1 (and below -1), and a small value between two steps
    x = torch.tensor([1.0 + 2**-10, -(1.0 + 2**-10), 3e-3 * (1 + 2**-9)])
    rounded = torch.stack([round_stochastic(x, torch.tensor(step)).float() for step in range(4000)])
    assert set(rounded[:, 0].unique().tolist()) == {1.0, 1.0 + 2**-7}
    assert 0.11 < (rounded[:, 0] > 1).float().mean() < 0.14
    torch.testing.assert_close(rounded.mean(0), x, rtol=2e-4, atol=0)
    # the same value and step round alike wherever they are (no generator's state)
    assert torch.equal(round_stochastic(x.repeat(3), torch.tensor(5)).float(), rounded[5].repeat(3))
    exact = torch.tensor([0.0, 1.0, -2.5, 2.0**-70])  # bfloat16 values stay themselves
    assert torch.equal(round_stochastic(exact, torch.tensor(3)).float(), exact)


def test_adamw_with_bfloat16_moments_updates_a_chunk_at_a_time_alike(monkeypatch):
    results = []
    for chunk in (bf16_state.CHUNK, 7):
        monkeypatch.setattr(bf16_state, "CHUNK", chunk)
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(5, 9))
        optimizer = AdamWBF16State([{"params": [p], "weight_decay": 0.1}], lr=1e-2,
                                   betas=(0.9, 0.999), eps=1e-8)
        for _ in range(3):
            p.grad = torch.randn(5, 9)
            optimizer.step()
        results.append((p.detach(), *optimizer.state[p].values()))
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_adamw_with_bfloat16_moments_follows_fp32_adamw_and_skips_on_found_inf():
    torch.manual_seed(0)
    start = torch.randn(64, 32)
    ours, theirs = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    mine = AdamWBF16State([{"params": [ours], "weight_decay": 0.1}], lr=1e-2, betas=(0.9, 0.999),
                          eps=1e-8)
    torch_adamw = torch.optim.AdamW([theirs], lr=1e-2, betas=(0.9, 0.999), eps=1e-8,
                                    weight_decay=0.1)
    for step in range(30):
        grad = torch.randn(64, 32) + 0.1 * step
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        mine.step()
        torch_adamw.step()
    assert mine.state[ours]["exp_avg"].dtype == torch.bfloat16
    # within 1% of how far the weights moved (measured: 0.7%)
    moved = (theirs.detach() - start).abs().max()
    torch.testing.assert_close(ours.detach(), theirs.detach(), rtol=0, atol=0.01 * moved)
    before = {k: v.clone() for k, v in mine.state[ours].items()}
    weight = ours.detach().clone()
    mine.found_inf = torch.tensor(1.0)
    mine.step()
    assert torch.equal(ours.detach(), weight)
    assert all(torch.equal(mine.state[ours][k], v) for k, v in before.items())
    # a checkpoint's state (this one's, or fp32 AdamW's) loads with the moments in bfloat16
    for saved in (mine.state_dict(), torch_adamw.state_dict()):
        loaded = AdamWBF16State([{"params": [ours], "weight_decay": 0.1}], lr=1e-2,
                                betas=(0.9, 0.999), eps=1e-8)
        loaded.load_state_dict(saved)
        assert loaded.state[ours]["exp_avg_sq"].dtype == torch.bfloat16
    torch.testing.assert_close(loaded.state[ours]["exp_avg"].float(),
                               torch_adamw.state[theirs]["exp_avg"], rtol=1e-2, atol=0)
