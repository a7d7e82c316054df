"""The output head's chunked loss (LMHead) against the plain cross-entropy of whole logits."""

import pytest
import torch
from reference import cross_entropy

from trainer import build_model
from trainer.models import init_weights, materialize
from trainer.models.head import IGNORE_INDEX, LMHead, set_loss_chunk


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def head_and_input(dtype, chunk):
    torch.manual_seed(0)
    head = LMHead(64, 500, chunk_tokens=chunk).to(dtype)
    h = torch.randn(3, 11, 64, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, 500, (3, 11))
    # ignored labels inside a chunk, and a whole row of them across chunks' edges
    labels[0, 3] = IGNORE_INDEX
    labels[2, :] = IGNORE_INDEX
    return head, h, labels


@pytest.mark.parametrize("chunk", [1, 7, 11, 33, None])
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_chunked_loss_and_gradients_equal_the_plain_loss(chunk, dtype, tolerance):
    head, h, labels = head_and_input(dtype, chunk)
    loss = head(h, labels)
    (0.37 * loss).backward()  # an upstream scale, as accumulation's 1/microbatches
    grads = h.grad, head.weight.grad
    h.grad = head.weight.grad = None
    plain = cross_entropy(head(h), labels)
    (0.37 * plain).backward()
    assert loss.dtype == torch.float32 and abs(loss.item() / plain.item() - 1) <= 1e-6
    assert (relative(grads[0], h.grad) <= tolerance
            and relative(grads[1], head.weight.grad) <= tolerance)
    assert grads[0].dtype == h.dtype and grads[1].dtype == head.weight.dtype


@pytest.mark.multiprocess  # inductor compiles C++ in a subprocess
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_the_compiled_chunks_equal_the_eager_ones(dtype, tolerance):
    """torch.compile's fused form of a chunk's elementwise work (training.compile) against the eager
    in-place one, a short last chunk included."""
    head, h, labels = head_and_input(dtype, 7)
    results = []
    for compiled in (False, True):
        set_loss_chunk(head, 7, compiled=compiled)
        loss = head(h, labels)
        loss.backward()
        results.append((loss.detach(), h.grad, head.weight.grad))
        h.grad = head.weight.grad = None
    (eager_loss, *eager), (loss, *grads) = results
    assert abs(loss.item() / eager_loss.item() - 1) <= 1e-6
    assert all(relative(a, b) <= tolerance for a, b in zip(grads, eager))


def test_without_grad_mode_only_the_loss_is_computed():
    head, h, labels = head_and_input(torch.float32, 7)
    with torch.no_grad():
        loss = head(h, labels)
    assert not loss.requires_grad
    assert abs(loss.item() / cross_entropy(head(h), labels).item() - 1) <= 1e-6


def test_every_label_ignored_gives_zero_not_nan():
    head, h, labels = head_and_input(torch.float32, 7)
    loss = head(h, torch.full_like(labels, IGNORE_INDEX))
    loss.backward()
    assert loss.item() == 0 and h.grad.abs().max() == 0


def test_a_tied_model_with_chunks_matches_its_whole_logits():
    model = build_model({"family": "llama", "dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
                         "vocab_size": 300, "ffn_dim": 64, "tie_embeddings": True}, device="meta")
    materialize(model, "cpu")
    init_weights(model, seed=0)
    tokens = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(1))
    set_loss_chunk(model, 4)
    model(tokens[:, :-1], labels=tokens[:, 1:]).backward()
    chunked = model.tok_embeddings.weight.grad.clone()
    model.zero_grad()
    cross_entropy(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    assert relative(chunked, model.tok_embeddings.weight.grad) <= 1e-6
