"""RMSNorm and SwiGLU with their own backward: torch's forward exactly, its gradients, and less
saved."""

import pytest
import torch
import torch.nn.functional as F

from trainer.models.layers import RMSNorm, _RMSNorm, swiglu


def saved_bytes(fn, *inputs) -> int:
    """Bytes of the distinct storages autograd saves while fn runs (parameters and inputs
    included)."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*inputs)
    return sum(storages.values())


@pytest.mark.parametrize("dtype, tol",
                         [(torch.float32, 1e-6), (torch.bfloat16, 0.0), (torch.float64, 1e-12)])
def test_rms_norm_computes_torchs_forward_and_its_gradients(dtype, tol):
    torch.manual_seed(0)
    x = torch.randn(3, 5, 64, dtype=dtype, requires_grad=True)
    plain, ours = torch.nn.RMSNorm(64, eps=1e-5).to(dtype), RMSNorm(64, eps=1e-5).to(dtype)
    with torch.no_grad():
        plain.weight.uniform_(0.5, 1.5)
        ours.weight.copy_(plain.weight)
    expected, out = plain(x), ours(x)
    assert torch.equal(out, expected)
    grad = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(expected, (x, plain.weight), grad),
                    torch.autograd.grad(out, (x, ours.weight), grad)):
        assert ((a - b).abs().max() / a.abs().max()).item() <= tol


def test_gradients_match_finite_differences():
    x, w = (torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True),
            torch.randn(8, dtype=torch.float64, requires_grad=True))
    assert torch.autograd.gradcheck(lambda x, w: _RMSNorm.apply(x, w, 1e-6), (x, w))
    gate, up = (torch.randn(4, 6, dtype=torch.float64, requires_grad=True) for _ in range(2))
    assert torch.autograd.gradcheck(swiglu, (gate, up))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_equals_the_plain_product_and_its_gradients(dtype):
    gate, up = (torch.randn(4, 7, 96, dtype=dtype, requires_grad=True) for _ in range(2))
    expected, out = F.silu(gate) * up, swiglu(gate, up)
    assert torch.equal(out, expected)
    grad = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(expected, (gate, up), grad),
                    torch.autograd.grad(out, (gate, up), grad)):
        assert torch.equal(a, b)


def test_they_save_the_inputs_and_a_scale_per_token_only():
    tokens, dim = 4 * 32, 64
    x = torch.randn(4, 32, dim, dtype=torch.bfloat16, requires_grad=True)
    plain, ours = torch.nn.RMSNorm(dim).bfloat16(), RMSNorm(dim).bfloat16()
    # The input, the weight and a float32 scale per token; torch's operators save the input and the
    # normalized input in float32 instead of the input.
    assert saved_bytes(ours, x) == 2 * tokens * dim + 2 * dim + 4 * tokens
    assert saved_bytes(plain, x) == 2 * 4 * tokens * dim + 2 * dim + 4 * tokens
    gate, up = (torch.randn(tokens, 96, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    assert saved_bytes(swiglu, gate, up) == 2 * 2 * tokens * 96
    assert saved_bytes(lambda g, u: F.silu(g) * u, gate, up) == 3 * 2 * tokens * 96
