"""The DeepSeek-V3 family: the released shapes' parameter counts, its rotary layout and its rules.
Its logits against transformers' are in test_hf.py, its layouts in test_parity.py, its plan in
test_plan.py."""

import pytest
import torch

from trainer.checks.job import check_job
from trainer.checks.overrides import compose_job
from trainer.errors import ConfigError
from trainer.models import build_model, count_params, model_config
from trainer.models.decoder import apply_rope, rope_cos_sin, rope_frequencies


def active(cfg) -> int:
    """Parameters a token runs through: all but the experts it is not routed to."""
    total = count_params(build_model(cfg, device="meta"))
    return total - len(cfg.moe_layers()) * (cfg.n_experts - cfg.top_k) * 3 * cfg.dim * cfg.ffn_dim


@pytest.mark.parametrize("name, total, active_params", [
    # published: 671B, 37B active (without the multi-token prediction module)
    ("deepseek_v3", 671.0e9, 37.6e9),
    ("kimi_k2", 1026.4e9, 32.9e9),  # published: 1T (1.04T), 32B active
    # published: 15.7B, 2.4B active (without the 0.2B embedding: 2.45B)
    ("deepseek_v2_lite", 15.71e9, 2.66e9),
])
def test_the_released_shapes_build_with_their_published_sizes(name, total, active_params):
    cfg = model_config(name)
    assert count_params(build_model(cfg, device="meta")) == pytest.approx(total, rel=1e-3)
    assert active(cfg) == pytest.approx(active_params, rel=2e-3)


def test_interleaved_rotary_pairs_turn_like_the_half_split_ones_of_the_permuted_input():
    """DeepSeek's pairs (x[2i], x[2i+1]) turned, and their gradient, are the half-split pairs of the
    input with its even and odd dimensions gathered into halves."""
    x = torch.randn(2, 6, 3, 8, dtype=torch.float64, requires_grad=True)
    cos, sin = rope_cos_sin(torch.arange(6).expand(2, 6), rope_frequencies(8, 100.0))
    halves = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
    grad = torch.randn(2, 6, 3, 8, dtype=torch.float64)
    (mine,) = torch.autograd.grad(apply_rope(x, cos, sin, interleaved=True), x, grad)
    (theirs,) = torch.autograd.grad(apply_rope(halves, cos, sin), x, grad)
    torch.testing.assert_close(apply_rope(x, cos, sin, interleaved=True),
                               apply_rope(halves, cos, sin))
    torch.testing.assert_close(mine, theirs)


def test_the_debug_model_trains_its_dense_and_moe_blocks():
    model = build_model("deepseek_v3_debug")
    loss = model(torch.randint(0, 2048, (2, 16)), labels=torch.randint(0, 2048, (2, 16)))
    loss.backward()
    assert model.layers["0"].feed_forward.w1.weight.grad.abs().sum() > 0  # a dense block
    assert model.layers["2"].feed_forward.experts.w1.grad.abs().sum() > 0  # an MoE block
    assert model.layers["2"].feed_forward.expert_bias is not None


def test_tensor_parallel_must_divide_the_latent_attention_heads():
    job = compose_job(["model=deepseek_v3_debug", "+recipe=llama_tp2", "parallel.tp=4",
                       "model.n_heads=6", "model.n_kv_heads=6", "training.seq_len=64"])
    with pytest.raises(ConfigError, match=r"parallel.tp=4 must divide model.n_heads=6"):
        check_job(job, world=4)
    with pytest.raises(ConfigError,
                       match=r"model.n_kv_heads=4 must equal model.n_heads=8: in latent attention"):
        check_job(compose_job(["model=deepseek_v3_debug", "model.n_kv_heads=4",
                               "training.seq_len=64"]), world=1)
