"""The data sources (embedded, text files, prepared binary), tokenizers, packing, and the split
of each global batch over data-parallel ranks."""

import json
import subprocess
import sys
from pathlib import Path

import torch
from helpers import REPO, torchrun, train_metrics

from trainer.config import DataConfig
from trainer.data import BatchLoader, ByteTokenizer, EmbeddedText, build_dataset
from trainer.errors import ConfigError
from trainer.tokenizer import build_tokenizer


def test_embedded_text_is_deterministic_readable_text():
    data = EmbeddedText(seq_len=200, seed=0)
    assert torch.equal(data[5], EmbeddedText(seq_len=200, seed=0)[5])
    assert not torch.equal(data[5], data[6])
    assert data[0].shape == (201,) and int(data[0].max()) < 256
    text = ByteTokenizer().decode(data[0].tolist())
    assert " is " in text or " the " in text


def global_batch(loader_for, dp_size, grad_accum, step, pp_microbatches=1):
    """The step's sequences in the job's microbatch order: microbatch by microbatch (a pipeline
    schedule's contiguous pieces included), each over the ranks."""
    pieces = []
    for rank in range(dp_size):
        for inputs, labels in loader_for(rank, dp_size, grad_accum, pp_microbatches).microbatches(step):
            assert torch.equal(inputs[:, 1:], labels[:, :-1])
            pieces.append(inputs.chunk(pp_microbatches))
    # pieces[rank * grad_accum + i][m]: rank's piece m of its microbatch i.
    return torch.cat([pieces[rank * grad_accum + i][m] for i in range(grad_accum) for m in range(pp_microbatches)
                      for rank in range(dp_size)])


def test_global_batch_does_not_depend_on_the_layout():
    data = EmbeddedText(seq_len=16, seed=0, size=40)

    def loader_for(rank, dp_size, grad_accum, pp_microbatches=1):
        return BatchLoader(data, global_batch=8, dp_rank=rank, dp_size=dp_size, grad_accum=grad_accum, seed=1,
                           pp_microbatches=pp_microbatches)

    for step in (0, 3, 7):  # step 7 crosses into the second epoch
        reference = global_batch(loader_for, 1, 1, step)
        assert reference.shape == (8, 16)
        # The same sequences in the same microbatches: 1 rank with 4 microbatches of 2 ...
        by_microbatch = global_batch(loader_for, 1, 4, step)
        assert torch.equal(by_microbatch, reference)
        # ... is 2 ranks accumulating 2, 2 ranks in a 2-microbatch pipeline, or 2 x 2 of each.
        for dp_size, grad_accum, pp_microbatches in ((2, 2, 1), (2, 1, 2), (2, 2, 2)):
            assert torch.equal(global_batch(loader_for, dp_size, grad_accum, step, pp_microbatches), reference)
        for dp_size, grad_accum in ((2, 1), (4, 1), (8, 1)):
            assert torch.equal(global_batch(loader_for, dp_size, grad_accum, step), reference)
    # Ranks read disjoint sequences, and consecutive steps differ.
    a, b = loader_for(0, 2, 1).microbatches(0)[0][0], loader_for(1, 2, 1).microbatches(0)[0][0]
    assert not any(torch.equal(x, y) for x in a for y in b)
    assert not torch.equal(global_batch(loader_for, 1, 1, 0), global_batch(loader_for, 1, 1, 1))


def test_text_file_source(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("hello world " * 100)
    data = build_dataset(DataConfig(source="text", path=str(path)), seq_len=32, seed=0)
    assert len(data) == (1200 + 1 - 1) // 32 - 1  # the text and its EOS, less one window held out
    assert ByteTokenizer().decode(data[0].tolist()).startswith("hello world")


def corpus(folder, n_files: int = 3) -> list[bytes]:
    texts = [f"document {i}: ".encode() + bytes(range(32, 127)) * (i + 2) + b"\n" for i in range(n_files)]
    folder.mkdir()
    for i, text in enumerate(texts):
        (folder / f"part{i}.txt").write_bytes(text)
    return texts


def all_windows(config: DataConfig, seq_len: int) -> list[torch.Tensor]:
    splits = [build_dataset(config, seq_len, seed=0, split=split) for split in ("train", "val")]
    return [data[i] for data in splits for i in range(len(data))]


def test_packing_keeps_every_token_once_in_file_order(tmp_path):
    """Documents (files, in sorted order) joined by EOS; windows overlap by one token, so their
    labels are the stream once, without loss or repetition; the last windows are the validation split."""
    texts = corpus(tmp_path / "corpus")
    stream = [t for text in texts for t in [*text, ByteTokenizer.eos_id]]
    windows = all_windows(DataConfig(source="text", path=str(tmp_path / "corpus" / "*.txt")), seq_len=16)
    labels = [t for w in windows for t in w[1:].tolist()]
    assert [windows[0][0].item(), *labels] == stream[: len(labels) + 1]
    assert len(stream) - len(labels) - 1 < 16  # only the last partial window is left out


def test_prepared_binary_file_is_the_same_stream(tmp_path):
    texts_dir = tmp_path / "corpus"
    corpus(texts_dir, n_files=5)
    out = tmp_path / "tokens.bin"
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "prepare_data.py"), str(texts_dir / "*.txt"),
                             str(out), "--workers", "2"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "tokens/s" in result.stdout
    assert json.loads(Path(f"{out}.json").read_text())["dtype"] == "uint16"
    text = all_windows(DataConfig(source="text", path=str(texts_dir / "*.txt")), seq_len=16)
    binary = all_windows(DataConfig(source="binary", path=str(out)), seq_len=16)
    assert len(text) == len(binary) and all(torch.equal(a, b) for a, b in zip(text, binary))


def test_hugging_face_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(["the cat sat on the mat"] * 20, trainers.BpeTrainer(
        vocab_size=60, special_tokens=["<|endoftext|>"]))
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("the cat sat on the mat " * 50)
    hf = build_tokenizer(str(tmp_path))
    assert hf.eos_id == 0 and hf.vocab_size == tokenizer.get_vocab_size()
    config = DataConfig(source="text", path=str(tmp_path / "docs" / "a.txt"), tokenizer=str(tmp_path))
    data = build_dataset(config, seq_len=8, seed=0)
    assert data.vocab_size == hf.vocab_size and hf.decode(data[0].tolist()).startswith("the cat sat")


def test_missing_data_path_is_a_config_error(tmp_path):
    import pytest

    with pytest.raises(ConfigError, match="data.path=.*missing.txt matches no readable file"):
        build_dataset(DataConfig(source="text", path=str(tmp_path / "missing.txt")), seq_len=32, seed=0)
    with pytest.raises(ConfigError, match="data.path=.*missing.bin is not a token file"):
        build_dataset(DataConfig(source="binary", path=str(tmp_path / "missing.bin")), seq_len=32, seed=0)
    with pytest.raises(ConfigError, match="data.tokenizer=.*nothing is neither 'bytes' nor a tokenizer.json"):
        build_tokenizer(str(tmp_path / "nothing"))
    with pytest.raises(ConfigError, match="data.source=hub is unknown"):
        build_dataset(DataConfig(source="hub"), seq_len=32, seed=0)


def test_training_on_text_files_with_validation(tmp_path):
    """The trainer reads a glob of the user's files, holds out the last windows, and both losses fall."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i in range(4):
        (folder / f"{i}.txt").write_text(" ".join(EmbeddedText(seq_len=4000, seed=i).tokenizer.decode(
            EmbeddedText(seq_len=4000, seed=i)[j].tolist()) for j in range(3)))
    records = train_metrics(2, "+recipe=llama_fsdp", "model=llama_debug", "+smoke=cpu", "data.source=text",
                            f"data.path={folder}/*.txt", "training.seq_len=64", "validation.every=10",
                            "validation.steps=1", output_dir=tmp_path / "run")
    losses, val = [r["loss"] for r in records], [r["val_loss"] for r in records if "val_loss" in r]
    assert losses[-1] < 0.6 * losses[0] and len(val) == 2 and val[-1] < val[0] and val[-1] < 0.6 * losses[0]


def test_tokenizer_larger_than_the_model_vocabulary_is_a_config_error(tmp_path):
    result = torchrun(1, "model=llama_debug", "+smoke=cpu", "model.vocab_size=200", output_dir=tmp_path)
    assert "config error: model.vocab_size=200 must be >= the tokenizer's 256 (data.tokenizer=bytes)" in result.stderr
