"""Input files of the wrong kind, and converter mistakes: each one `config error:` naming the file and
what to do, never a traceback from the library underneath."""

import json
import sys
from pathlib import Path

import pytest

from trainer.checkpoint.hf import config_from_hf
from trainer.data.files import documents
from trainer.errors import ConfigError
from trainer.tokenizer import build_tokenizer

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
import convert_hf  # noqa: E402


def test_a_tokenizer_file_that_is_not_a_tokenizer(tmp_path):
    (tmp_path / "tokenizer.json").write_text("not json at all")
    with pytest.raises(ConfigError, match=r"^data.tokenizer=.*tokenizer.json is not a tokenizer the tokenizers"):
        build_tokenizer(str(tmp_path))


def test_a_parquet_source_that_is_not_parquet(tmp_path):
    (tmp_path / "a.parquet").write_text("hello, I am text")
    (tmp_path / "b.parquet").write_bytes(b"")  # empty: counted and passed over, like an empty text file
    with pytest.raises(ConfigError, match=r"a.parquet is not a parquet file \(data.source=parquet\)"):
        list(documents("parquet", str(tmp_path / "*.parquet")))


@pytest.mark.parametrize("config, message", [
    (None, r"is not a Hugging Face model directory: it has no config.json"),
    ("{not json", r"config.json is not JSON"),
    ({"model_type": "llama", "num_hidden_layers": 2}, r"config.json lacks hidden_size, num_attention_heads"),
    ({"model_type": "gpt2", "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 10,
      "intermediate_size": 8, "rms_norm_eps": 1e-5}, r"model_type=gpt2 is not supported \(llama, mixtral\)"),
    ({"model_type": "mixtral", "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 10,
      "intermediate_size": 8, "rms_norm_eps": 1e-5}, r"config.json lacks num_local_experts: not a mixtral config"),
])
def test_a_hugging_face_directory_that_is_not_one(tmp_path, config, message):
    if config is not None:
        (tmp_path / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    with pytest.raises(ConfigError, match=message):
        config_from_hf(tmp_path)


def test_the_converter_says_one_config_error_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        convert_hf.main(["from-hf", str(tmp_path / "missing"), str(tmp_path / "out")])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("config error: ") and err.count("\n") == 1 and "missing is not a Hugging Face model" in err
