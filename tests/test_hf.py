"""Hugging Face interop: random transformers models, built here with no download,
imported and exported by scripts/convert_hf.py and load_weights, give the same logits."""

import json

import pytest
import torch
from helpers import REPO, launch, run_script, spawn
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from trainer import build_model, load_weights
from trainer.checkpoint import safetensors_io
from trainer.checkpoint.hf import config_from_hf
from trainer.checkpoint.state import saved_config
from trainer.errors import ConfigError

SHAPE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5)
# Llama 3.1's rotary scaling with an original context
# of 32 tokens, shorter than the 80 of `tokens()`.
LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=5000.0, factor=8.0, low_freq_factor=1.0,
                   high_freq_factor=4.0, original_max_position_embeddings=32)
# DeepSeek-V3: MLA with a query latent, YaRN (an original context of 32, beyond it the mscale in the
# softmax), 4 groups of which a token uses 2, a shared
# expert; then without the query latent or groups.
DEEPSEEK = dict(SHAPE, num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=8,
                num_experts_per_tok=2, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                v_head_dim=16, first_k_dense_replace=1, num_hidden_layers=3, norm_topk_prob=True,
                num_nextn_predict_layers=0, max_position_embeddings=128)
DEEPSEEK_YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                     original_max_position_embeddings=32, beta_fast=32.0, beta_slow=1.0,
                     mscale=0.707, mscale_all_dim=0.707)
FAMILIES = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(rope_theta=5000.0, **SHAPE)),
    "llama3_rope": lambda: LlamaForCausalLM(LlamaConfig(rope_parameters=LLAMA3_ROPE,
                                                        max_position_embeddings=128, **SHAPE)),
    "mixtral": lambda: MixtralForCausalLM(MixtralConfig(num_local_experts=4, num_experts_per_tok=2,
                                                        **SHAPE)),
    # Heads wider than hidden_size / heads (32, not 16), tied embeddings.
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(head_dim=32, tie_word_embeddings=True,
                                                  rope_theta=1e6, **SHAPE)),
    "qwen3_moe": lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig(
        head_dim=32, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
        norm_topk_prob=True, **SHAPE)),
    "deepseek_v3": lambda: DeepseekV3ForCausalLM(DeepseekV3Config(
        q_lora_rank=16, n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5,
        rope_parameters=DEEPSEEK_YARN, **DEEPSEEK)),
    "deepseek_v3_no_q_lora": lambda: DeepseekV3ForCausalLM(DeepseekV3Config(
        q_lora_rank=None, n_group=1, topk_group=1, n_shared_experts=2, routed_scaling_factor=1.0,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0), **DEEPSEEK)),
}


def hf_model(family: str, path):
    torch.manual_seed(0)
    model = FAMILIES[family]().eval()
    with torch.no_grad():  # norm weights other than ones, so that a norm mapped to another shows
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
        for name, buffer in model.named_buffers():  # DeepSeek-V3's bias in the experts' choice
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.1)
    model.save_pretrained(path)
    return model


def tokens() -> torch.Tensor:
    return torch.randint(0, 300, (2, 80), generator=torch.Generator().manual_seed(1))


def convert(*args: str) -> None:
    result = run_script(REPO / "scripts" / "convert_hf.py", *args)
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.multiprocess
@pytest.mark.parametrize("family", FAMILIES)
def test_import_and_export_keep_transformers_logits(family, tmp_path):
    hf = hf_model(family, tmp_path / "hf")
    with torch.no_grad():
        expected = hf(tokens()).logits

    # Straight from the Hugging Face directory.
    ours = build_model(config_from_hf(tmp_path / "hf"))
    load_weights(ours, tmp_path / "hf")
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens()), expected, rtol=1e-5, atol=1e-5)

    # Converted to a checkpoint of ours, then back to a Hugging Face directory.
    convert("from-hf", tmp_path / "hf", tmp_path / "ours")
    converted = build_model(saved_config(tmp_path / "ours"), seed=7)
    load_weights(converted, tmp_path / "ours")
    # float32, in shards of at most 60 kB (the model is about 400 kB; the 77 kB embedding gets one
    # of its own): transformers reads the index.
    convert("to-hf", tmp_path / "ours", tmp_path / "back", "--dtype", "float32", "--max-shard-size",
            "60KB")
    index = tmp_path / "back" / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"]
    shards = {s: [name for name, file in weight_map.items() if file == s]
              for s in set(weight_map.values())}
    assert len(shards) > 4
    for shard, names in shards.items():
        assert (tmp_path / "back" / shard).stat().st_size <= 60_000 + 4096 or len(names) == 1, shard
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert type(back) is type(hf)
    # Both forms of the rotary settings, for transformers before 5 and after.
    written = json.loads((tmp_path / "back" / "config.json").read_text())
    assert written["rope_theta"] == written["rope_parameters"]["rope_theta"]
    assert (written["rope_scaling"] is None) == (family not in ("llama3_rope", "deepseek_v3"))
    with torch.no_grad():
        torch.testing.assert_close(converted(tokens()), expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(back(tokens()).logits, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.multiprocess
def test_export_defaults_to_bfloat16_in_one_file(tmp_path):
    hf_model("mixtral", tmp_path / "hf")
    convert("from-hf", tmp_path / "hf", tmp_path / "ours")
    convert("to-hf", tmp_path / "ours", tmp_path / "back")
    assert (sorted(p.name for p in (tmp_path / "back").iterdir())
            == ["config.json", "model.safetensors"])
    assert json.loads((tmp_path / "back" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    written = load_file(tmp_path / "back" / "model.safetensors")
    expected = {name: t.to(torch.bfloat16)
                for name, t in load_file(tmp_path / "hf" / "model.safetensors").items()}
    assert written.keys() == expected.keys()
    for name, tensor in written.items():
        assert torch.equal(tensor, expected[name]), name


def test_safetensors_blocks_read_without_a_memory_map(tmp_path, monkeypatch):
    g = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(7, 5, 3, generator=g),
               "b": torch.randn(9, generator=g).to(torch.bfloat16)}
    save_file(tensors, tmp_path / "x.safetensors")
    # rows with sliced columns: read in chunks of 2
    monkeypatch.setattr(safetensors_io, "CHUNK_BYTES", 40)
    file = safetensors_io.SafetensorsFile(tmp_path / "x.safetensors")
    for box in [(slice(0, 7), slice(0, 5), slice(0, 3)), (slice(2, 6), slice(0, 5), slice(0, 3)),
                (slice(1, 6), slice(2, 4), slice(0, 3)), (slice(0, 7), slice(0, 5), slice(1, 2)),
                (slice(3, 3), slice(0, 5), slice(0, 3))]:
        assert torch.equal(file.read("a", box), tensors["a"][box]), box
    assert torch.equal(file.read("b", (slice(4, 9),)), tensors["b"][4:])


def test_a_truncated_hugging_face_shard_is_a_config_error(tmp_path):
    hf_model("llama", tmp_path)
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:-100])
    model = build_model(config_from_hf(tmp_path))
    with pytest.raises(ConfigError, match="model.safetensors is truncated: .* ends at byte"):
        load_weights(model, tmp_path)


def test_rotary_scaling_read_from_either_form_and_refused_when_unknown(tmp_path):
    hf_model("llama3_rope", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    scaling = config_from_hf(tmp_path).rope_scaling
    assert (scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor,
            scaling.original_max_seq_len) == (8.0, 1.0, 4.0, 32)
    old = {k: v for k, v in config.items() if k != "rope_parameters"}  # as transformers 4 writes it
    old |= {"rope_theta": 5000.0,
            "rope_scaling": {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}}
    (tmp_path / "config.json").write_text(json.dumps(old))
    assert (config_from_hf(tmp_path).rope_scaling == scaling
            and config_from_hf(tmp_path).rope_theta == 5000.0)
    longrope = {"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}
    (tmp_path / "config.json").write_text(json.dumps(old | longrope))
    with pytest.raises(ConfigError,
                       match=r"rope type longrope is not supported \(default, llama3, yarn\)"):
        config_from_hf(tmp_path)
    yarn = {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    (tmp_path / "config.json").write_text(json.dumps(old | yarn))
    with pytest.raises(ConfigError, match="rope type yarn needs original_max_position_embeddings"):
        config_from_hf(tmp_path)


def test_rotary_layout_matters(tmp_path):
    """The check above can fail: with q/k rows in Meta's interleaved rotary layout (the
    permutation transformers' conversion undoes), the logits no longer match."""
    hf = hf_model("llama", tmp_path / "hf")
    ours = build_model(config_from_hf(tmp_path / "hf"))
    load_weights(ours, tmp_path / "hf")
    head_dim = 16
    with torch.no_grad():
        for proj in (ours.layers["0"].attention.wq, ours.layers["0"].attention.wk):
            rows = proj.weight.view(-1, 2, head_dim // 2, 64).transpose(1, 2)
            rows = rows.reshape(proj.weight.shape)
            proj.weight.copy_(rows)
        assert not torch.allclose(ours(tokens()), hf(tokens()).logits, atol=1e-3)


@pytest.mark.multiprocess
@pytest.mark.parametrize("family, recipe", [("llama", "llama_tp2"), ("mixtral", "mixtral_ep")])
def test_initial_weights_from_a_hugging_face_directory(family, recipe, tmp_path):
    """checkpoint.initial=HF_DIR starts a sharded run from those weights, each rank reading its
    slices (tensor parallel; experts split over ep ranks): lr 0 keeps them, and the final
    checkpoint holds them."""
    hf = hf_model(family, tmp_path / "hf")
    shape = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=300, ffn_dim=96)
    shape |= (dict(rope_theta=5000.0) if family == "llama"
              else dict(n_experts=4, top_k=2, rope_theta=1e6))
    model = [f"model={family}_debug", *(f"model.{k}={v}" for k, v in shape.items())]
    result = launch(2, f"+recipe={recipe}", "+smoke=cpu", *model, "training.steps=1",
                    "training.lr=0", "training.seq_len=32", f"checkpoint.initial={tmp_path / 'hf'}",
                    "checkpoint.enabled=true", output_dir=tmp_path / "run")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"initial weights from {tmp_path / 'hf'}" in result.stdout
    ours = build_model(config_from_hf(tmp_path / "hf"))
    load_weights(ours, tmp_path / "run" / "checkpoints" / "step_1")
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens()), hf(tokens()).logits, rtol=1e-5, atol=1e-5)


def peak_rss_mib() -> float:
    """This process's peak resident memory (VmHWM: unlike ru_maxrss, not inherited from the parent
    that forked it)."""
    line = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


def _load_by_slices(rank, world, path, expected_file):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from trainer.models import materialize

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    model = build_model(config_from_hf(path), device="meta")
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    materialize(model, "cpu")
    load_weights(model, path)
    peak_mib = peak_rss_mib()
    expected = torch.load(expected_file)
    with torch.no_grad():
        torch.testing.assert_close(model(expected["tokens"]), expected["logits"], rtol=1e-5,
                                   atol=1e-5)
    peaks = [None] * world
    torch.distributed.all_gather_object(peaks, peak_mib)
    model_mib = expected["bytes"] / 2**20
    print(f"rank {rank}: peak RSS {peak_mib:.0f} MiB; all ranks {[round(p) for p in peaks]} MiB; "
          f"model {model_mib:.0f} MiB")
    assert max(peaks) < 0.75 * model_mib, (
        f"peak RSS per rank {peaks} MiB, the model is {model_mib:.0f} MiB")


@pytest.mark.multiprocess
def test_four_fsdp_ranks_read_only_their_slices_of_a_300m_model(tmp_path):
    """checkpoint.initial=HF_DIR on 4 ranks: each rank's peak memory stays well under the model's
    size (each reads its own slices), and the logits are transformers' own."""
    config = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=4096,
                         num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8,
                         rope_theta=500000.0)
    torch.manual_seed(0)
    hf = LlamaForCausalLM(config).eval()
    hf.save_pretrained(tmp_path / "hf", max_shard_size="300MB")
    tokens = torch.randint(0, 32000, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = {"tokens": tokens, "logits": hf(tokens).logits,
                    "bytes": sum(p.numel() * p.element_size() for p in hf.parameters())}
    torch.save(expected, tmp_path / "expected.pt")
    del hf
    spawn(_load_by_slices, 4, tmp_path / "hf", tmp_path / "expected.pt", timeout=300)


def _rewrite_header(path, edit) -> None:
    """The safetensors file at `path` with its header's entries passed through `edit`."""
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + length])
    edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + length:])


@pytest.mark.parametrize("edit, message", [
    # b's range moved onto a's: two entries share bytes
    (lambda h: h["b"].update(data_offsets=[h["a"]["data_offsets"][0],
                                           h["a"]["data_offsets"][0] + 18]),
     "overlapping entries"),
    # a's shape no longer what its bytes hold
    (lambda h: h["a"].update(shape=[3, 2]), r"hold 420 bytes, not the 24 of its dtype F32"),
    (lambda h: h["a"].update(data_offsets=[0, "x"]), "shape or data_offsets are not counts"),
])
def test_a_safetensors_entry_whose_bytes_do_not_match_its_header_is_refused(tmp_path, edit,
                                                                              message):
    """As the safetensors library refuses it (the header reader here is the project's own)."""
    save_file({"a": torch.zeros(7, 5, 3), "b": torch.zeros(9, dtype=torch.bfloat16)},
              tmp_path / "x.safetensors")
    _rewrite_header(tmp_path / "x.safetensors", edit)
    with pytest.raises(ConfigError, match=message):
        safetensors_io.SafetensorsFile(tmp_path / "x.safetensors")
