"""The public build_model API, Llama's properties, and an initialisation independent of layout."""

import pytest
import torch
from helpers import spawn

from trainer import build_model
from trainer.checkpoint.state import check_same_shape
from trainer.config.schema import ModelConfig
from trainer.errors import ConfigError
from trainer.models import count_params, init_weights, materialize, model_config
from trainer.models.moe_config import MoEConfig
from trainer.parallel.fsdp import apply_fsdp

TINY = {"family": "llama", "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
        "vocab_size": 300, "ffn_dim": 96}


def test_build_model_by_name_gives_the_debug_size():
    model = build_model("llama_debug")
    assert 5e6 < count_params(model) < 8e6
    assert len(model.layers) == 8
    logits = model(torch.randint(0, 2048, (2, 16)))
    assert logits.shape == (2, 16, 2048) and logits.dtype == torch.float32


def test_build_model_from_mapping_or_dataclass():
    for spec in (TINY, ModelConfig(**TINY)):
        model = build_model(spec)
        assert model(torch.randint(0, 300, (1, 5))).shape == (1, 5, 300)


# A model config as versions before the families declared their own keys saved it (a checkpoint's
# model_config.yaml, a run's config.yaml): every key
# of every family, at its unused value where unused.
EARLIER = {**TINY, "name": "tiny", "norm_eps": 1e-5, "rope_theta": 10000.0, "rope_scaling": None,
           "max_seq_len": 2048, "tie_embeddings": False, "head_dim": None, "n_experts": 0,
           "top_k": 0, "aux_loss_coef": 0.0, "z_loss_coef": 0.0, "capacity_factor": None,
           "route_score": "softmax", "route_norm": True, "route_scale": 1.0, "n_shared_experts": 0,
           "n_expert_groups": 1, "top_groups": 1, "bias_update_speed": 0.0}


def test_a_model_config_saved_by_an_earlier_version_reads_as_before():
    assert model_config(EARLIER) == model_config({**TINY, "name": "tiny"})
    moe = model_config({**EARLIER, "family": "qwen3_moe", "n_experts": 4, "top_k": 2})
    # null: dim / n_heads
    assert isinstance(moe, MoEConfig) and (moe.n_experts, moe.top_k, moe.head_dim) == (4, 2, 16)
    other = model_config({**TINY, "family": "qwen3_moe", "n_experts": 4, "top_k": 2,
                          "head_dim": 16})
    check_same_shape(moe, other, "checkpoint.initial")
    with pytest.raises(ConfigError,
                       match=r"model.n_experts is not a key of model.family=llama; it is one of "
                             r"model.family=deepseek_v3 or mixtral or qwen3_moe"):
        model_config({**EARLIER, "n_experts": 4})  # a value that means something is not dropped
    with pytest.raises(ConfigError, match=r"model.top_k=two must be an integer"):
        model_config({**TINY, "family": "mixtral", "top_k": "two"})


def test_attention_is_causal():
    model = build_model(TINY)
    tokens = torch.randint(0, 300, (1, 12))
    changed = tokens.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % 300
    torch.testing.assert_close(model(tokens)[0, :8], model(changed)[0, :8])
    assert not torch.allclose(model(tokens)[0, 8:], model(changed)[0, 8:])


def test_positions_feed_the_rotary_embedding():
    model = build_model(TINY)
    tokens = torch.randint(0, 300, (2, 12))
    positions = torch.arange(12).expand(2, 12)
    torch.testing.assert_close(model(tokens, positions), model(tokens))
    # Rotary attention sees only relative positions: a shift changes nothing, a reorder does.
    torch.testing.assert_close(model(tokens, positions + 100), model(tokens), rtol=1e-4, atol=1e-4)
    assert not torch.allclose(model(tokens, positions.flip(1)), model(tokens), atol=1e-3)


def test_grouped_query_attention_equals_repeated_kv_heads():
    """GQA with 2 kv heads is multi-head attention whose k/v weights repeat each head."""
    gqa = build_model(TINY)
    mha = build_model({**TINY, "n_kv_heads": 4})
    shared = {k: v for k, v in gqa.state_dict().items()
              if not k.endswith(("wk.weight", "wv.weight"))}
    mha.load_state_dict(shared, strict=False)
    head_dim = 16
    with torch.no_grad():
        for name in ("wk", "wv"):
            for g, m in zip(gqa.layers.values(), mha.layers.values()):
                w = getattr(g.attention, name).weight.view(2, head_dim, 64)
                repeated = w.repeat_interleave(2, dim=0).reshape(64, 64)
                getattr(m.attention, name).weight.copy_(repeated)
    tokens = torch.randint(0, 300, (2, 10))
    torch.testing.assert_close(gqa(tokens), mha(tokens))


def test_tied_output_shares_the_embedding():
    model = build_model({**TINY, "tie_embeddings": True})
    assert model.output.weight is model.tok_embeddings.weight


def test_initialisation_is_seeded_by_name():
    a, b, c = build_model(TINY, seed=0), build_model(TINY, seed=0), build_model(TINY, seed=1)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.layers["0"].attention.wq.weight, c.layers["0"].attention.wq.weight)
    assert torch.equal(a.norm.weight, torch.ones(64))
    assert abs(a.layers["1"].feed_forward.w1.weight.std().item() - 0.02) < 0.003


def _sharded_init_matches_unsharded(rank, world_size, tie):
    from trainer.parallel.dims import ParallelDims

    spec = {**TINY, "tie_embeddings": tie, "vocab_size": 301}  # 301 rows: uneven shards
    dims = ParallelDims(dp_replicate=1, dp_shard=world_size, cp=1, tp=1, pp=1, ep=1,
                        world_size=world_size)
    dims.build_mesh("cpu")
    model = build_model(spec, device="meta")
    apply_fsdp(model, list(model.layers.values()), model.tok_embeddings, [model.norm, model.output],
               dims.fsdp_mesh, torch.float32, torch.float32)
    materialize(model, "cpu")
    init_weights(model, seed=3)
    reference = dict(build_model(spec, seed=3).named_parameters())
    for name, param in model.named_parameters():
        assert torch.equal(param.full_tensor(), reference[name]), name
    if tie:
        assert model.output.weight is model.tok_embeddings.weight


@pytest.mark.multiprocess
def test_sharded_initialisation_equals_the_single_process_one():
    spawn(_sharded_init_matches_unsharded, 3, False)
    spawn(_sharded_init_matches_unsharded, 2, True)


# Qwen's published sizes: all parameters, and those a token uses (its top_k experts of 128).
RELEASED = {"qwen3_0_6b": (0.60e9, None), "qwen3_8b": (8.19e9, None), "qwen3_32b": (32.8e9, None),
            "qwen3_30b_a3b": (30.5e9, 3.3e9), "qwen3_235b_a22b": (235e9, 22e9)}


@pytest.mark.parametrize("name", RELEASED)
def test_released_qwen3_shapes_build_on_meta_with_their_parameter_counts(name):
    model = build_model(name, device="meta")
    cfg = model.config
    total, active = RELEASED[name]
    assert count_params(model) == pytest.approx(total, rel=0.01)
    attention = model.layers["0"].attention
    assert (attention.wq.weight.shape == (cfg.n_heads * 128, cfg.dim)
            and attention.q_norm.weight.shape == (128,))
    if active is not None:
        unused = (cfg.n_experts - cfg.top_k) * 3 * cfg.dim * cfg.ffn_dim * cfg.n_layers
        assert count_params(model) - unused == pytest.approx(active, rel=0.02)
    if cfg.tie_embeddings:
        assert model.output.weight is model.tok_embeddings.weight
