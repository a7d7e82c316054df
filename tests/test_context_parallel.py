"""Context-parallel attention: each method, on 2 and 4 gloo ranks, is full causal attention (kept
within documents, too)."""

import pytest
import torch
from helpers import spawn
from torch.distributed.device_mesh import init_device_mesh

from trainer.data import document_positions
from trainer.models import attention as attention_kernels
from trainer.models.attention import CausalAttention
from trainer.parallel.context_parallel import METHODS, ContextParallelAttention, shard_sequence


def test_shard_sequence_gives_each_rank_an_early_and_a_late_chunk():
    x = torch.arange(8)[None]
    assert [shard_sequence(x, r, 2).tolist() for r in range(2)] == [[[0, 1, 6, 7]], [[2, 3, 4, 5]]]
    assert ([shard_sequence(x, r, 4).tolist() for r in range(4)]
            == [[[0, 7]], [[1, 6]], [[2, 5]], [[3, 4]]])
    assert torch.equal(shard_sequence(x, 0, 1), x)


def _matches_full_attention(rank, cp, method, fused, documents=False):
    if not fused:  # the exact math kernel, which devices without a fused one use
        attention_kernels.KERNELS = {}
    attention = ContextParallelAttention(init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",)),
                                         method, documents)
    full_attention = CausalAttention()
    full_attention.within_documents = documents
    for seq in (2 * cp, 16 * cp, 14 * cp):
        for kv_heads in (4, 2, 1):  # multi-head, grouped-query, multi-query
            g = torch.Generator().manual_seed(seq + kv_heads)
            q = torch.randn(2, 4, seq, 8, generator=g, requires_grad=True)
            k = torch.randn(2, kv_heads, seq, 8, generator=g, requires_grad=True)
            v = torch.randn(2, kv_heads, seq, 8, generator=g, requires_grad=True)
            grad_out = torch.randn(2, 4, seq, 8, generator=g)
            # Documents: token 0 (EOS) ends one, about one token in five.
            positions = document_positions(torch.randint(0, 5, (2, seq), generator=g), eos_id=0)
            expected = full_attention(q, k, v, positions)
            expected.backward(grad_out)

            def local(x, dim=2):
                return shard_sequence(x.detach(), rank, cp, dim=dim)

            q_local, k_local, v_local = (local(x).requires_grad_() for x in (q, k, v))
            out = attention(q_local, k_local, v_local, local(positions, dim=1))
            out.backward(local(grad_out))
            where = (f"{method} fused={fused} documents={documents} cp={cp} seq={seq} "
                     f"kv_heads={kv_heads} rank={rank}")
            torch.testing.assert_close(out, local(expected), rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"{where}: {m}")
            for name, mine, full in (("q", q_local, q), ("k", k_local, k), ("v", v_local, v)):
                torch.testing.assert_close(mine.grad, local(full.grad), rtol=1e-5, atol=1e-5,
                                           msg=lambda m: f"{where} d{name}: {m}")


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("method, fused, documents", [
    ("ring", True, False), ("ring", False, False), ("allgather", True, False), ("ring", True, True),
    ("allgather", True, True),
])
@pytest.mark.multiprocess
def test_attention_and_its_gradients_equal_full_attention(method, fused, documents, cp):
    assert set(METHODS) == {"ring", "allgather"}
    spawn(_matches_full_attention, cp, method, fused, documents)
