"""Context-parallel attention: each method, on 2 and 4 gloo ranks, is full causal attention (kept
within documents, too)."""

import pytest
import torch
from helpers import spawn
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.profiler import profile

from trainer.data import document_positions
from trainer.models import attention as attention_kernels
from trainer.models.attention import CausalAttention
from trainer.parallel.activation_checkpoint import apply_activation_checkpoint
from trainer.parallel.context_parallel import METHODS, ContextParallelAttention, shard_sequence


def test_shard_sequence_gives_each_rank_an_early_and_a_late_chunk():
    x = torch.arange(8)[None]
    assert [shard_sequence(x, r, 2).tolist() for r in range(2)] == [[[0, 1, 6, 7]], [[2, 3, 4, 5]]]
    assert ([shard_sequence(x, r, 4).tolist() for r in range(4)]
            == [[[0, 7]], [[1, 6]], [[2, 5]], [[3, 4]]])
    assert torch.equal(shard_sequence(x, 0, 1), x)


# (method, fused kernels, document masks, Ulysses degree or "all"): ulysses is Ulysses alone, the
# others with a Ulysses degree are the hybrid (the method across Ulysses groups)
CASES = [("ring", True, False, 1), ("ring", False, False, 1), ("allgather", True, False, 1),
         ("ring", True, True, 1), ("allgather", True, True, 1), ("ulysses", True, False, "all"),
         ("ulysses", False, True, "all"), ("ring", True, True, 2), ("allgather", True, False, 2)]


def _meshes(cp: int, method: str, ulysses):
    """The (ring, Ulysses) meshes ContextParallelAttention takes."""
    if method == "ulysses":
        return None, init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
    if ulysses == 1:
        return init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",)), None
    mesh = init_device_mesh("cpu", (cp // ulysses, ulysses), mesh_dim_names=("ring", "ulysses"))
    return mesh["ring"], mesh["ulysses"]


def _matches_full_attention(rank, cp):
    kernels = attention_kernels.KERNELS
    for method, fused, documents, ulysses in CASES:
        if ulysses != "all" and cp % (2 * ulysses):
            continue  # (a hybrid needs a ring of two or more)
        # not fused: the exact math kernel, which devices without a fused one use
        attention_kernels.KERNELS = kernels if fused else {}
        attention = ContextParallelAttention(*_meshes(cp, method, ulysses), method, documents)
        _check_against_full_attention(attention, rank, cp, documents,
                                      f"{method} ulysses={ulysses} fused={fused} "
                                      f"documents={documents} cp={cp} rank={rank}")
    _selective_checkpointing_keeps_the_all_to_alls(cp)


def _selective_checkpointing_keeps_the_all_to_alls(cp):
    """Ulysses' two all-to-alls run once forward and once backward under every selective policy,
    not a third time in the recomputed forward (full checkpointing does run them again)."""
    attention = ContextParallelAttention(*_meshes(cp, "ulysses", "all"), "ulysses", False)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(8, 3 * 4 * 8)

        def forward(self, x):
            q, k, v = self.qkv(x).unflatten(-1, (3, 4, 8)).transpose(1, 3).unbind(2)
            return attention(q, k, v, None).sin()

    for mode, policy, expected in (("none", "ops", 4), ("selective", "ops", 4),
                                   ("selective", "half_mm", 4), ("full", "ops", 6)):
        blocks = nn.ModuleDict({"0": Block()})
        apply_activation_checkpoint(blocks, mode, policy=policy)
        with profile() as prof:
            blocks["0"](torch.randn(2, 2 * cp, 8)).sum().backward()
        sent = sum(event.name == "gloo:all_to_all" for event in prof.events())
        assert sent == expected, f"{mode} {policy}: {sent} all-to-alls, not {expected}"


def _check_against_full_attention(attention, rank, cp, documents, case):
    full_attention = CausalAttention()
    full_attention.within_documents = documents
    for seq in (2 * cp, 14 * cp):
        for kv_heads in (4, 2, 1):  # multi-head, grouped-query, multi-query
            g = torch.Generator().manual_seed(seq + kv_heads)
            # multi-head with values narrower than the keys, as DeepSeek-V3's MLA
            width = 6 if kv_heads == 4 else 8
            q = torch.randn(2, 4, seq, 8, generator=g, requires_grad=True)
            k = torch.randn(2, kv_heads, seq, 8, generator=g, requires_grad=True)
            v = torch.randn(2, kv_heads, seq, width, generator=g, requires_grad=True)
            grad_out = torch.randn(2, 4, seq, width, generator=g)
            # Documents: token 0 (EOS) ends one, about one token in five.
            positions = document_positions(torch.randint(0, 5, (2, seq), generator=g), eos_id=0)
            expected = full_attention(q, k, v, positions)
            expected.backward(grad_out)

            def local(x, dim=2):
                return shard_sequence(x.detach(), rank, cp, dim=dim)

            q_local, k_local, v_local = (local(x).requires_grad_() for x in (q, k, v))
            out = attention(q_local, k_local, v_local, local(positions, dim=1))
            out.backward(local(grad_out))
            where = f"{case} seq={seq} kv_heads={kv_heads}"
            torch.testing.assert_close(out, local(expected), rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"{where}: {m}")
            for name, mine, full in (("q", q_local, q), ("k", k_local, k), ("v", v_local, v)):
                torch.testing.assert_close(mine.grad, local(full.grad), rtol=1e-5, atol=1e-5,
                                           msg=lambda m: f"{where} d{name}: {m}")


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.multiprocess
def test_attention_and_its_gradients_equal_full_attention(cp):
    """Every method (ring, allgather, Ulysses, the hybrid), fused kernels and the math one, with and
    without document masks, multi-head (narrow values too), grouped- and multi-query."""
    assert set(METHODS) == {"ring", "allgather", "ulysses"}
    spawn(_matches_full_attention, cp)
