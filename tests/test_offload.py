"""training.offload=activations' hooks on their own: what a block saves goes to host memory and
comes back with the same bits, the block before fetched while a block's backward runs, weights
left alone."""

import torch
from torch import nn

from trainer.parallel.offload import ActivationOffload
from trainer.tensors import HOST_COPY_LISTENERS


class Logged(ActivationOffload):
    def __init__(self):
        super().__init__(torch.device("cpu"))
        self.fetched: list[int] = []
        self.blocks: dict[int, int] = {}  # id of a block call -> its index

    def _fetch(self, block):
        self.fetched.append(self.blocks.setdefault(id(block), len(self.blocks)))
        super()._fetch(block)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.LayerNorm(64))
                           for _ in range(3)))


def _grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model(x).square().sum().backward()
    return [p.grad for p in model.parameters()]


def test_saved_tensors_go_to_the_host_and_come_back_the_same():
    x = torch.randn(32, 64)
    plain = _grads(_model(), x)
    model, offload, copies = _model(), Logged(), []
    offload.attach(list(model))
    def log(*_):  # the blocks' calls in forward order
        offload.blocks.setdefault(id(offload.last()), len(offload.blocks))

    for block in model:
        block.register_forward_hook(log)
    HOST_COPY_LISTENERS.append(copies.append)
    try:
        offloaded = _grads(model, x)
    finally:
        HOST_COPY_LISTENERS.remove(copies.append)
    assert all(torch.equal(a, b) for a, b in zip(offloaded, plain))
    # each block's input, GELU's input and output, the norm's input: none of them a weight
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert len(copies) >= 3 * 3 and not any(c.untyped_storage().data_ptr() in weights
                                            for c in copies)
    assert all(c.shape == (32, 64) for c in copies)
    # backward from the last block: each block's tensors, then the one before it, ahead of use
    assert offload.fetched[:2] == [2, 1] and offload.fetched[2:] == [1, 0, 0]
    assert not offload.hooks  # every block's hooks closed
