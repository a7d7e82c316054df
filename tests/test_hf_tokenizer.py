"""The tokenizer travels with the weights: a checkpoint keeps the files of the tokenizer it was
trained with, and the Hugging Face export writes them with the right special ids, so that
transformers' AutoTokenizer encodes as training did and `generate` stops on the trained
end-of-sequence token."""

import json
import sys

import pytest
from helpers import REPO
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer

from trainer import build_model
from trainer.checkpoint.state import save_weights
from trainer.data.tokenizer import build_tokenizer
from trainer.errors import ConfigError

sys.path.insert(0, str(REPO / "scripts"))
import convert_hf  # noqa: E402

TEXT = ["the quick brown fox jumps over the lazy dog", "a stitch in time saves nine",
        "\"quoted\" words, too"]


def bpe_tokenizer(folder):
    """A byte-level BPE whose end-of-sequence token is id 0 (where transformers' default is 2)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(TEXT * 20, trainer)
    folder.mkdir()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return folder


def test_an_export_generates_with_its_own_tokenizer_and_stops_on_its_eos(tmp_path, capsys):
    spec = str(bpe_tokenizer(tmp_path / "tok"))
    trained = build_tokenizer(spec)
    assert trained.eos_id == 0 and trained.vocab_size <= 300
    model = build_model({"family": "llama", "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
                         "vocab_size": 300, "ffn_dim": 96}, seed=0)
    # The final norm's weight zeroed: every logit is 0 and greedy decoding picks id 0, the EOS.
    model.norm.weight.data.zero_()
    save_weights(model.config, dict(model.state_dict()), tmp_path / "ckpt", tokenizer=spec)
    convert_hf.to_hf(tmp_path / "ckpt", tmp_path / "hf", None, "float32", "5GB")
    said = capsys.readouterr().out
    assert "wrote the tokenizer" in said and "eos 0" in said, said

    hf_tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert hf_tokenizer.eos_token_id == 0
    for text in TEXT:
        assert hf_tokenizer(text, add_special_tokens=False).input_ids == trained.encode(text)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["eos_token_id"], config["bos_token_id"]) == (0, None)
    hf_model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    prompt = hf_tokenizer(TEXT[0], return_tensors="pt")
    out = hf_model.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert out[0, prompt.input_ids.shape[1]:].tolist() == [0]  # one token, the EOS, and it stopped


def test_an_export_without_a_tokenizer_says_so_and_claims_no_ids(tmp_path, capsys):
    model = build_model("llama_debug", seed=0)
    save_weights(model.config, dict(model.state_dict()), tmp_path / "ckpt")
    convert_hf.to_hf(tmp_path / "ckpt", tmp_path / "hf", None, "bfloat16", "5GB")
    assert "no tokenizer:" in capsys.readouterr().out
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["eos_token_id"] is None and config["bos_token_id"] is None
    with pytest.raises(ConfigError,
                       match=r"has ids up to 299, beyond the model's vocabulary of 256"):
        small = build_model({"family": "llama", "dim": 32, "n_layers": 1, "n_heads": 2,
                             "n_kv_heads": 2,
                             "vocab_size": 256, "ffn_dim": 64}, seed=0)
        save_weights(small.config, dict(small.state_dict()), tmp_path / "small")
        convert_hf.to_hf(tmp_path / "small", tmp_path / "hf2", None, "bfloat16", "5GB",
                         str(bpe_tokenizer(tmp_path / "tok")))


def test_a_shape_mismatch_names_every_key_and_from_hf_writes_the_model_config(tmp_path, monkeypatch,
                                                                              capsys):
    """checkpoint.initial from a directory of another shape: one error naming every differing key
    with the overrides that match it (applied, the check passes); from-hf --write-config makes the
    config."""
    from omegaconf import OmegaConf
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainer.checkpoint.folders import CheckpointError
    from trainer.checkpoint.hf import config_from_hf
    from trainer.checkpoint.state import check_same_shape
    from trainer.config import files as config_files
    from trainer.models import model_config

    LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96,
                                 num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2,
                                 rope_theta=5000.0)).save_pretrained(tmp_path / "hf")
    theirs, ours = config_from_hf(tmp_path / "hf"), model_config("llama_debug")
    with pytest.raises(CheckpointError) as e:
        check_same_shape(ours, theirs, "checkpoint.initial=hf")
    message = str(e.value)
    for key in ("dim=64", "n_layers=2", "n_heads=4", "n_kv_heads=2", "vocab_size=300",
                "ffn_dim=96"):
        assert f"model.{key} (this model:" in message, message
    overrides = message.split("to train it, add ")[1].split()
    model_overrides = OmegaConf.from_dotlist([o[len("model."):] for o in overrides])
    matched = OmegaConf.merge(OmegaConf.structured(ours), model_overrides)
    check_same_shape(OmegaConf.to_object(matched), theirs, "checkpoint.initial=hf")

    (tmp_path / "configs" / "model").mkdir(parents=True)
    monkeypatch.setattr(config_files, "CONFIG_DIR", tmp_path / "configs")
    convert_hf.from_hf(tmp_path / "hf", tmp_path / "ours", None, write_config="my_llama")
    assert "train it with model=my_llama" in capsys.readouterr().out
    check_same_shape(model_config("my_llama"), theirs, "checkpoint.initial=hf")
    with pytest.raises(ConfigError, match=r"--write-config=my_llama: .* exists"):
        convert_hf.from_hf(tmp_path / "hf", tmp_path / "ours2", None, write_config="my_llama")


def test_auto_takes_the_tokenizer_beside_the_initial_weights(tmp_path):
    from trainer.checkpoint.tokenizer_files import resolve_tokenizer

    held = bpe_tokenizer(tmp_path / "hf")
    (tmp_path / "bare").mkdir()
    assert resolve_tokenizer("auto", "text", str(held)) == str(held)
    assert resolve_tokenizer("auto", "text", str(tmp_path / "bare")) == "bytes"
    assert resolve_tokenizer("auto", "embedded", str(held)) == "bytes"  # the embedded text is bytes
    assert resolve_tokenizer("auto", "text", None) == "bytes"
    assert resolve_tokenizer("bytes", "text", str(held)) == "bytes"  # said: kept
    assert build_tokenizer("auto").vocab_size == build_tokenizer("bytes").vocab_size


@pytest.mark.multiprocess
def test_a_run_from_hugging_face_weights_trains_with_their_tokenizer(tmp_path):
    """checkpoint.initial from an export that holds its tokenizer, data.tokenizer not given: the run
    tokenizes with it (said once), and its own checkpoint keeps it."""
    from helpers import launch

    spec = str(bpe_tokenizer(tmp_path / "tok"))
    shape = {"family": "llama", "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
             "vocab_size": 300, "ffn_dim": 96}
    model = build_model(shape, seed=0)
    save_weights(model.config, dict(model.state_dict()), tmp_path / "ckpt", tokenizer=spec)
    convert_hf.to_hf(tmp_path / "ckpt", tmp_path / "hf", None, "float32", "5GB")
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text(" ".join(TEXT * 30))
    result = launch(1, "model=llama_debug", *(f"model.{k}={v}" for k, v in shape.items()),
                    "+smoke=cpu", "training.steps=2", "training.seq_len=16", "data.source=text",
                    f"data.path={tmp_path}/corpus/*.txt", f"checkpoint.initial={tmp_path / 'hf'}",
                    "checkpoint.enabled=true", f"data.cache_dir={tmp_path / 'cache'}",
                    output_dir=tmp_path / "run")
    assert result.returncode == 0, result.stderr[-3000:]
    said = f"data.tokenizer=auto takes the tokenizer beside checkpoint.initial: {tmp_path / 'hf'}"
    assert result.stdout.count(said) == 1, result.stdout
    from omegaconf import OmegaConf

    # reruns compare it
    assert OmegaConf.load(tmp_path / "run" / "config.yaml").data.tokenizer == str(tmp_path / "hf")
    kept = tmp_path / "run" / "checkpoints" / "step_2" / "tokenizer.json"
    assert kept.read_text() == (tmp_path / "tok" / "tokenizer.json").read_text()
