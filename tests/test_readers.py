"""The sources a run reads (text, json, jsonl and parquet files, a prepared binary file, a streamed
dataset) and the tokenizers: the token stream each makes, and what they pass over."""

import json
import random
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import REPO, run_script

from trainer.config.schema import DataConfig
from trainer.data import STREAM_VAL_WINDOWS, BatchLoader, ByteTokenizer, build_dataset, sentence
from trainer.data.readers import SAID
from trainer.data.tokenizer import CHUNK_CHARS, build_tokenizer
from trainer.errors import ConfigError


def test_text_file_source(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("hello world " * 100)
    data = build_dataset(DataConfig(source="text", path=str(path)), seq_len=32, seed=0)
    assert len(data) == (1200 + 1 - 1) // 32 - 1  # the text and its EOS, less one window held out
    assert ByteTokenizer().decode(data[0].tolist()).startswith("hello world")


def corpus(folder, n_files: int = 3) -> list[bytes]:
    texts = [f"document {i}: ".encode() + bytes(range(32, 127)) * (i + 2) + b"\n"
             for i in range(n_files)]
    folder.mkdir()
    for i, text in enumerate(texts):
        (folder / f"part{i}.txt").write_bytes(text)
    return texts


def all_windows(config: DataConfig, seq_len: int) -> list[torch.Tensor]:
    splits = [build_dataset(config, seq_len, seed=0, split=split) for split in ("train", "val")]
    return [data[i] for data in splits for i in range(len(data))]


def test_packing_keeps_every_token_once_in_file_order(tmp_path):
    """Documents (files, in sorted order) joined by EOS; windows overlap by one token, so their
    labels are the stream once, without loss or repetition; the last windows are the validation
    split."""
    texts = corpus(tmp_path / "corpus")
    stream = [t for text in texts for t in [*text, ByteTokenizer.eos_id]]
    windows = all_windows(DataConfig(source="text", path=str(tmp_path / "corpus" / "*.txt")),
                          seq_len=16)
    labels = [t for w in windows for t in w[1:].tolist()]
    assert [windows[0][0].item(), *labels] == stream[: len(labels) + 1]
    assert len(stream) - len(labels) - 1 < 16  # only the last partial window is left out


@pytest.mark.multiprocess
def test_prepared_binary_file_is_the_same_stream(tmp_path):
    """prepare_data.py's workers share even one big file (cut into pieces) and write the stream the
    trainer reads from the text files."""
    texts_dir = tmp_path / "corpus"
    corpus(texts_dir, n_files=5)
    (texts_dir / "part5_big.txt").write_text("".join(f"line {i}: {'abc ' * (i % 40)}\n"
                                                     for i in range(66_000)))
    out = tmp_path / "tokens.bin"
    result = run_script(REPO / "scripts" / "prepare_data.py", texts_dir / "*.txt", out, "--workers",
                        "2")
    assert result.returncode == 0, result.stderr
    assert "tokens/s" in result.stdout
    assert json.loads(Path(f"{out}.json").read_text())["dtype"] == "uint16"
    text, binary = (build_dataset(DataConfig(source=source, path=path), seq_len=16, seed=0)
                    for source, path in (("text", str(texts_dir / "*.txt")), ("binary", str(out))))
    # More of prepare_data.py's work groups (4 pieces of CHUNK_CHARS each) than it keeps in flight.
    assert len(text.tokens) > 5 * 4 * CHUNK_CHARS and np.array_equal(text.tokens, binary.tokens)


def test_json_jsonl_and_parquet_rows_are_documents(tmp_path):
    """Rows of json, jsonl and parquet files (read through Hugging Face datasets) are documents,
    the text in data.text_field: the same stream as text files holding them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [f"row {i}: " + "some words " * (i + 3) for i in range(12)]
    (tmp_path / "txt").mkdir()
    for i, text in enumerate(texts):
        (tmp_path / "txt" / f"{i:02d}.txt").write_text(text)
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"body": t, "id": i}) + "\n"
                                              for i, t in enumerate(texts[:6])))
    (tmp_path / "b.json").write_text("".join(json.dumps({"body": t}) + "\n" for t in texts[6:]))
    pq.write_table(pa.table({"body": texts[:6]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"body": texts[6:]}), tmp_path / "b.parquet")
    expected = all_windows(DataConfig(source="text", path=str(tmp_path / "txt" / "*.txt")),
                           seq_len=16)
    for source, pattern in (("json", "*.json*"), ("parquet", "*.parquet")):
        config = DataConfig(source=source, path=str(tmp_path / pattern), text_field="body")
        windows = all_windows(config, seq_len=16)
        assert len(windows) == len(expected), source
        assert all(torch.equal(a, b) for a, b in zip(windows, expected)), source
    wanted = r"data.text_field=text is not a column of .*; its columns are \['body', 'id'\]"
    with pytest.raises(ConfigError, match=wanted):
        build_dataset(DataConfig(source="json", path=str(tmp_path / "a.jsonl")), seq_len=16, seed=0)
    # the column is there, but not text
    (tmp_path / "numbers.jsonl").write_text("".join(json.dumps({"text": i}) + "\n"
                                                    for i in range(3)) + '{"text": null}\n')
    with pytest.raises(ConfigError, match=r"data.text_field=text of .*numbers.jsonl holds no text: "
                                          r"its values are null, numbers, not strings"):
        build_dataset(DataConfig(source="json", path=str(tmp_path / "numbers.jsonl")), seq_len=16,
                      seed=0)


def test_unreadable_parts_of_files_are_counted_and_passed_over(tmp_path, capsys):
    """Undecodable bytes (read as U+FFFD), malformed JSON lines, rows without the text field and
    empty files are counted per file and said once (again by each job reading the cached tokens);
    the rest reads as usual. data.strict=true refuses the first of them, naming file and place."""
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "a.txt").write_bytes(b"good text " * 20)
    (tmp_path / "t" / "b.txt").write_bytes(b"caf\xe9 and \xff more. " * 10)  # latin-1: 20 bad bytes
    (tmp_path / "t" / "c.txt").write_bytes(b"")
    lines = [{"text": "row one " * 5}, "{not json", {"id": 3}, ["a list"], {"text": "row two " * 5}]
    (tmp_path / "j").mkdir()
    (tmp_path / "j" / "a.jsonl").write_text("\n".join(x if isinstance(x, str) else json.dumps(x)
                                                      for x in lines))
    (tmp_path / "j" / "b.jsonl").write_text("\n\n")
    t, j = tmp_path / "t", tmp_path / "j"
    for _ in range(2):  # tokenized, then read from the cache by another job (a process of its own)
        SAID.clear()
        texts = build_dataset(DataConfig(source="text", path=str(t / "*.txt")), seq_len=16, seed=0,
                              split="all")
        # the training windows and the validation ones: each problem said once
        rows, _ = (build_dataset(DataConfig(source="json", path=str(j / "*.jsonl")), seq_len=16,
                                 seed=0, split=split) for split in ("all", "val"))
        said = capsys.readouterr().out
        assert said.count("data: passed over 2 lines that are not a JSON object") == 1, said
        assert (f"data: passed over 20 bytes that are not UTF-8 (read as U+FFFD): {t}/b.txt: 20 "
                f"(the first at byte 3) (of data.path={t}/*.txt; data.strict=true refuses "
                "them)") in said, said
        assert f"data: passed over 1 empty files: {t}/c.txt (of data.path={t}/*.txt;" in said
        assert (f"data: passed over 2 lines that are not a JSON object: {j}/a.jsonl: 2 (the first "
                "at line 2)" in said)
        assert (f"data: passed over 1 rows without a text in data.text_field: {j}/a.jsonl: 1 "
                "(the first at row 2)") in said
        assert f"data: passed over 1 empty files: {j}/b.jsonl" in said
    # and an EOS each
    assert texts.tokens.size == 200 + len("caf\ufffd and \ufffd more. ".encode()) * 10 + 2
    assert rows.tokens.size == 2 * (40 + 1)
    for path, message in ((t / "b.txt", "b.txt at byte 3: bytes that are not UTF-8"),
                          (j / "a.jsonl", "a.jsonl at line 2: not a JSON object")):
        with pytest.raises(ConfigError, match=f"data.strict=true: .*{message}"):
            build_dataset(DataConfig(source="json" if path.suffix == ".jsonl" else "text",
                                     path=str(path), strict=True,
                                     cache_dir=str(tmp_path / "fresh")), seq_len=16, seed=0)
    # cached leniently
    with pytest.raises(ConfigError,
                       match="data.strict=true: .*a.jsonl at line 2: not a JSON object"):
        build_dataset(DataConfig(source="json", path=str(j / "*.jsonl"), strict=True), seq_len=16,
                      seed=0)


def test_hub_dataset_streams_in_order_each_rank_its_shard(tmp_path):
    """data.source=hub streams a dataset by name (here a local folder, as the Hub would serve it):
    the first windows are the validation split and training leaves their documents out; each
    data-parallel rank reads a shard of its own (every other row here: one file), in stream order,
    starting over at its end."""
    texts = [" ".join(sentence(random.Random(i)) for _ in range(4)) for i in range(400)]
    (tmp_path / "hub").mkdir()
    (tmp_path / "hub" / "train.jsonl").write_text("".join(json.dumps({"text": t}) + "\n"
                                                          for t in texts))
    config = DataConfig(source="hub", path=str(tmp_path / "hub"))

    def stream(docs):
        return [t for text in docs for t in [*text.encode(), ByteTokenizer.eos_id]]

    val, train = (build_dataset(config, seq_len=8, seed=0, split=split)
                  for split in ("val", "train"))
    assert len(val) == STREAM_VAL_WINDOWS and val[3].tolist() == stream(texts)[24:33]
    held = next(n for n in range(len(texts)) if len(stream(texts[:n])) >= 8 * STREAM_VAL_WINDOWS
                + 1)
    # one rank: every document after the held-out ones
    assert train[0].tolist() == stream(texts[held:])[:9]
    loader = BatchLoader(train, global_batch=4, dp_rank=1, dp_size=2, grad_accum=1, seed=0)
    ((inputs, labels),) = loader.microbatches(step=2)  # rank 1's windows 4 and 5: two a step
    shard = stream([texts[i] for i in range(1, len(texts), 2) if i >= held])
    assert inputs[0].tolist() == shard[32:40] and inputs[1].tolist() == shard[40:48]
    assert labels[1].tolist() == shard[41:49]
    resumed = BatchLoader(train, global_batch=4, dp_rank=1, dp_size=2, grad_accum=1, seed=0)
    resumed.offset = loader.position(steps=2)  # a run resumed after 2 steps reads on from there
    assert torch.equal(resumed.microbatches(0)[0][0], inputs)
    wrapped = (len(shard) - 1) // 8 + 5  # a window past the shard's end
    assert loader.stream[wrapped].tolist() == (shard * 2)[8 * wrapped :][:9]
    assert loader.stream[0].tolist() == shard[:9]  # going back reads the shard again


@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_hub_stream_says_what_it_passes_over_on_rank_0_only(tmp_path, capsys, monkeypatch, rank):
    rows = [{"text": " ".join(sentence(random.Random(i)) for _ in range(4))} for i in range(300)]
    rows[5] = {"title": "no text here"}
    (tmp_path / "hub").mkdir()
    (tmp_path / "hub" / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    monkeypatch.setenv("RANK", rank)
    SAID.clear()
    # the validation windows, and the training stream, which reads them again to leave them out
    for split in ("val", "train"):
        build_dataset(DataConfig(source="hub", path=str(tmp_path / "hub")), seq_len=8, seed=0,
                      split=split)
    said = capsys.readouterr().out
    assert said.count("data: passed over 1 rows without a text in "
                      "data.text_field") == (rank == "0"), said


def test_unreachable_hub_dataset_fails_fast_naming_it():
    started = time.perf_counter()
    with pytest.raises(ConfigError,
                       match="data.path=no-such-user/no-such-dataset: cannot stream the Hugging "
                             "Face dataset no-such-user/no-such-dataset"):
        build_dataset(DataConfig(source="hub", path="no-such-user/no-such-dataset"), seq_len=8,
                      seed=0)
    assert time.perf_counter() - started < 30


def test_hugging_face_tokenizer_with_bos_and_eos(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(["the cat sat on the mat"] * 20, trainers.BpeTrainer(
        vocab_size=60, special_tokens=["<|endoftext|>", "<s>", "</s>"]))
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("the cat sat on the mat " * 50)
    (tmp_path / "docs" / "b.txt").write_text("the mat")
    hf = build_tokenizer(str(tmp_path))
    assert hf.eos_id == 0 and hf.bos_id is None and hf.vocab_size == tokenizer.get_vocab_size()
    config = DataConfig(source="text", path=str(tmp_path / "docs" / "*.txt"),
                        tokenizer=str(tmp_path))
    data = build_dataset(config, seq_len=8, seed=0)
    assert (data.vocab_size == hf.vocab_size
            and hf.decode(data[0].tolist()).startswith("the cat sat"))
    # A Llama-style config: documents start with BOS and end with EOS.
    llama = tmp_path / "llama"
    llama.mkdir()
    tokenizer.save(str(llama / "tokenizer.json"))
    (llama / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>",
                                                             "eos_token": {"content": "</s>"}}))
    hf = build_tokenizer(str(llama))
    assert (hf.bos_id, hf.eos_id) == (1, 2)
    config = DataConfig(source="text", path=str(tmp_path / "docs" / "*.txt"), tokenizer=str(llama))
    windows = all_windows(config, 8)
    tokens = [windows[0][0].item(), *(t for w in windows for t in w[1:].tolist())]
    a, b = (hf.encode((tmp_path / "docs" / name).read_text()) for name in ("a.txt", "b.txt"))
    expected = [1, *a, 2, 1, *b, 2]
    assert tokens == expected[: len(tokens)] and len(expected) - len(tokens) < 8
