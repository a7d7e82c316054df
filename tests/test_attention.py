"""Every attention kernel this device runs, against float64 attention written out: outputs and
gradients, float32 and bfloat16, multi-head / grouped-query / multi-query, causal or not, with and
without document masks."""

import itertools

import pytest
import torch

from trainer.data import document_positions
from trainer.models import attention as kernels
from trainer.models import attention_kernels as fused
from trainer.models.attention import Mask, attention, block_forward

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}  # of the largest value of each tensor


def reference(q, k, v, causal, mask):
    """float64 softmax attention, heads repeated for grouped queries."""
    q, k, v = (x.double() for x in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    seen = torch.ones(scores.shape[-2:], dtype=torch.bool)
    if causal:
        seen = seen.tril()
    if mask is not None:  # query i sees key j from its document's start up to itself
        keys, queries = mask.keys[None, None, :], mask.queries[None, :, None]
        starts = 0 if mask.starts is None else mask.starts[:, :, None]
        seen = seen & ((keys <= queries) & (keys >= starts))[:, None]
    return scores.masked_fill(~seen, float("-inf")).softmax(-1) @ v


def cases():
    """(name, causal, rows, cols, mask): a whole sequence, causal or not; a block of later queries
    against all the keys (the all-gather method), causal by index, or within documents; a whole
    sequence within documents."""
    # Documents: token 0 (EOS) ends one, about one token in five.
    tokens = torch.randint(0, 5, (2, 40), generator=torch.Generator().manual_seed(0))
    positions = document_positions(tokens, eos_id=0)
    starts = torch.arange(40) - positions
    later, every = torch.arange(16, 40), torch.arange(40)
    yield "causal", True, 40, 40, None
    yield "full", False, 40, 40, None
    yield "later queries", False, 24, 40, Mask(later, every)
    yield "later queries, documents", False, 24, 40, Mask(later, every, starts[:, 16:])
    yield "causal, documents", True, 40, 40, Mask(every, every, starts)


def inputs(rows, cols, kv_heads, dtype, seed, v_width=16):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, rows, 16, generator=g)
    k, v = (torch.randn(2, kv_heads, cols, 16, generator=g),
            torch.randn(2, kv_heads, cols, v_width, generator=g))
    return [x.to(dtype).requires_grad_() for x in (q, k, v)]


def relative_error(mine, expected) -> float:
    return ((mine.double() - expected).abs().max() / expected.abs().max()).item()


@pytest.mark.parametrize("kernel", ["sdpa", "cpu_flash", "math"])
def test_kernel_and_its_gradients_match_float64_attention(kernel, monkeypatch):
    monkeypatch.setattr(kernels, "KERNELS",
                        {"cpu": {"attention": kernel, "masked attention": kernel}})
    # Values as wide as the keys, and narrower (MLA's: the fused kernels see them padded).
    for dtype, kv_heads, v_width, (name, causal, rows, cols, mask) in itertools.product(
            (torch.float32, torch.bfloat16), (4, 2, 1), (16, 8), cases()):
        q, k, v = inputs(rows, cols, kv_heads, dtype, seed=rows + kv_heads, v_width=v_width)
        seeded = torch.Generator().manual_seed(1)
        grad_out = torch.randn(*q.shape[:-1], v_width, generator=seeded).to(dtype)
        out = attention(q, k, v, causal, mask)
        assert out.dtype == dtype
        grads = torch.autograd.grad(out, (q, k, v), grad_out)
        q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
        expected = reference(q64, k64, v64, causal, mask)
        expected_grads = torch.autograd.grad(expected, (q64, k64, v64), grad_out.double())
        where = f"{kernel} {dtype} kv_heads={kv_heads} v_width={v_width} {name}"
        for what, mine, theirs in zip(("out", "dq", "dk", "dv"), (out, *grads),
                                      (expected, *expected_grads)):
            assert mine.dtype == dtype, f"{where}: {what} is {mine.dtype}"
            error = relative_error(mine, theirs)
            assert error < TOLERANCE[dtype], f"{where}: {what} off by {error}"


@pytest.mark.filterwarnings("ignore:.*flex_attention called without torch.compile")
def test_flex_attention_block_mask_matches_float64_attention(monkeypatch):
    # CPU FlexAttention has no backward (torch 2.13): its
    # forward checks the block mask built from `Mask`.
    monkeypatch.setattr(kernels, "KERNELS", {"cpu": {"masked attention": "flex"}})
    for v_width, (name, causal, rows, cols, mask) in itertools.product((16, 8), cases()):
        if mask is None:
            continue
        q, k, v = (x.detach() for x in inputs(rows, cols, 2, torch.float32, seed=rows,
                                              v_width=v_width))
        out = attention(q, k, v, causal, mask)
        expected = reference(q, k, v, causal, mask)
        assert relative_error(out, expected) < TOLERANCE[torch.float32], (name, v_width)


def test_the_memory_efficient_backward_gets_the_output_laid_out_as_its_forward_made_it(monkeypatch):
    # CUDA's kernel: in half precision it reads the output at a row stride of heads x width,
    # whatever the tensor's strides say; an output [b, heads,
    # rows, d]-contiguous gave wrong gradients on an H200.
    given = {}

    def kernel(dout, q, k, v, bias, out, *rest):
        given["out"] = out
        return q, k, v, None

    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_efficient_attention_backward", kernel)
    q, k, v = (x.detach() for x in inputs(8, 8, 2, torch.bfloat16, seed=0))
    out = torch.randn(2, 4, 8, 16).to(torch.bfloat16)
    fused._efficient_backward(torch.ones_like(out), q, k, v, out, torch.zeros(2, 4, 8), True, None)
    assert torch.equal(given["out"], out) and given["out"].transpose(1, 2).is_contiguous()


@pytest.mark.parametrize("kernel", ["cpu_flash", "math"])
def test_a_row_that_sees_no_key_of_a_block_has_no_weight(kernel, monkeypatch):
    # A ring block from another document: query 0's document starts after every key of the block.
    monkeypatch.setattr(kernels, "KERNELS", {"cpu": {"masked block": kernel}})
    q, k, v = (x.detach() for x in inputs(4, 8, 2, torch.float32, seed=0))
    starts = torch.tensor([[20, 0, 0, 0]]).expand(2, 4)
    out, lse = block_forward(q, k, v, False, Mask(torch.arange(20, 24), torch.arange(8), starts))
    assert (out[:, :, 0] == 0).all() and (lse[:, :, 0] == float("-inf")).all()
    assert torch.isfinite(out[:, :, 1:]).all() and torch.isfinite(lse[:, :, 1:]).all()
