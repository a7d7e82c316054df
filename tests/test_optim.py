"""Learning-rate schedule, weight-decay groups and clipping."""

import math

import torch

from trainer.config.schema import OptimConfig
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
