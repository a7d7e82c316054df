"""Data at scale: each rank holds O(its share). Text sources are tokenized once into a memory-mapped
cache (one process tokenizes, the others wait for its file), token files are checked against their
description and tokenizer, and each epoch's order is computed index by index, never materialised."""

import json
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from helpers import REPO

import trainer.data.cache as cache
from trainer.config.schema import DataConfig
from trainer.data import build_dataset
from trainer.data.order import Shuffled, permute, round_keys
from trainer.data.readers import TokenFile
from trainer.errors import ConfigError


def test_each_epoch_is_a_permutation_of_its_own():
    for n in (1, 2, 3, 17, 64, 65, 1000, 4099):
        orders = [permute(np.arange(n), n, round_keys(0, epoch)) for epoch in (0, 1)]
        assert all(sorted(order.tolist()) == list(range(n)) for order in orders), n
        if n > 3:
            assert not np.array_equal(*orders), n
    # Index by index, as the loader asks: the same as all at once; another seed, another order.
    order = permute(np.arange(1000), 1000, round_keys(5, 0))
    assert ([int(permute(np.array([i]), 1000, round_keys(5, 0))[0]) for i in (0, 7, 999)]
            == order[[0, 7, 999]].tolist())
    assert not np.array_equal(order, permute(np.arange(1000), 1000, round_keys(6, 0)))
    # Shuffled reads epoch after epoch, every window once per epoch.
    stream = Shuffled(list(range(10)), 3)
    assert sorted(stream.take(range(10))) == list(range(10)) == sorted(stream.take(range(10, 20)))
    assert stream.take(range(10)) != stream.take(range(10, 20))


def test_text_is_tokenized_once_into_a_shared_cache(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i in range(3):
        (folder / f"{i}.txt").write_text(f"document {i} " * 200)
    config = DataConfig(source="text", path=str(folder / "*.txt"),
                        cache_dir=str(tmp_path / "cache"))
    calls, encode = [], cache.encode_documents

    def slow_encode(documents, tokenizer):  # long enough for the second reader to meet the lock
        calls.append(threading.current_thread().name)
        time.sleep(0.5)
        return encode(documents, tokenizer)

    monkeypatch.setattr(cache, "encode_documents", slow_encode)
    results = {}
    def read(n: int) -> None:
        results.setdefault(n, build_dataset(config, 16, 0))

    readers = [threading.Thread(target=read, args=(n,), name=f"r{n}") for n in range(2)]
    for reader in readers:
        reader.start()
        time.sleep(0.1)
    for reader in readers:
        reader.join(timeout=60)
    # one tokenized; the other waited and read its file
    assert len(calls) == 1 and len(results) == 2
    first, second = results.values()
    assert isinstance(first.tokens, TokenFile) and np.array_equal(first.tokens, second.tokens)
    assert first.tokens[:1].dtype == np.uint16 and len(first.tokens) == 3 * (11 * 200 + 1)
    assert (len(list((tmp_path / "cache").glob("*.bin"))) == 1
            and not list((tmp_path / "cache").glob("*tmp*")))
    build_dataset(config, 16, 0, split="val")  # the other split: the same file
    assert len(calls) == 1
    (folder / "1.txt").write_text("changed " * 300)  # another file, another cache
    changed = build_dataset(config, 16, 0)
    assert len(calls) == 2 and not np.array_equal(changed.tokens[:3000], first.tokens[:3000])
    assert capsys.readouterr().out.count("data: tokenizing 3 file(s)") == 2


def test_token_files_from_another_tokenizer_or_cut_short_are_config_errors(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    (tmp_path / "a.txt").write_text("the cat sat on the mat " * 100)
    config = DataConfig(source="text", path=str(tmp_path / "a.txt"),
                        cache_dir=str(tmp_path / "cache"))
    build_dataset(config, 16, 0)
    (cached,) = (tmp_path / "cache").glob("*.bin")
    meta_path = cached.with_name(cached.name + ".json")
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({**meta, "tokenizer_hash": "0123456789abcdef",
                                     "tokenizer": "other.json"}))
    with pytest.raises(ConfigError,
                       match=r"the token cache .* was tokenized with other.json, not with this "
                             r"data.tokenizer .*: delete it"):
        build_dataset(config, 16, 0)
    meta_path.write_text(json.dumps(meta))
    with open(cached, "r+b") as f:
        f.truncate(100)
    with pytest.raises(ConfigError,
                       match=r"holds 100 bytes, not the 4602 its .json describes .*truncated"):
        build_dataset(config, 16, 0)
    # A prepared token file read with another tokenizer than it was made with.
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(["the cat sat on the mat"] * 20, trainers.BpeTrainer(
        vocab_size=60, special_tokens=["<|endoftext|>"]))
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    meta_path.write_text(json.dumps(meta))
    cached.write_bytes(b"\0" * 4602)
    with pytest.raises(ConfigError,
                       match=r"data.path=.*\.bin was tokenized with bytes, not with this "
                             r"data.tokenizer"):
        build_dataset(DataConfig(source="binary", path=str(cached), tokenizer=str(tmp_path)), 16, 0)


RSS_PROBE = """
import re, sys
sys.path.insert(0, sys.argv[2])
from trainer.config.schema import DataConfig
from trainer.data import BatchLoader, build_dataset
data = build_dataset(DataConfig(source="binary", path=sys.argv[1]), seq_len=16, seed=0)
loader = BatchLoader(data, global_batch=64, dp_rank=1, dp_size=2, grad_accum=1, seed=0)
loader.offset = len(data) + len(data) // 2  # mid second epoch
for step in range(40):
    loader.microbatches(step)
# (VmHWM, not ru_maxrss, which keeps the peak of the process that forked this one)
print(int(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) // 1024)
"""


@pytest.mark.multiprocess
def test_a_rank_holds_its_share_not_the_corpus(tmp_path):
    """Peak RSS of a rank reading batches from a 200 MB token file stays within a few MB of a 2 MB
    one's: the file is memory-mapped and the epoch's order (6M windows here) is never built."""
    peaks = {}
    for name, tokens in (("small", 1_000_000), ("large", 100_000_000)):
        path = tmp_path / f"{name}.bin"
        with open(path, "wb") as f:
            for start in range(0, tokens, 10**7):
                values = np.arange(start, min(tokens, start + 10**7)) * 7 % 251 + 1
                values.astype(np.uint16).tofile(f)
        meta = {"dtype": "uint16", "tokens": tokens, "vocab_size": 256, "eos_id": 0, "bos_id": None}
        path.with_name(path.name + ".json").write_text(json.dumps(meta))
        result = subprocess.run([sys.executable, "-c", RSS_PROBE, str(path), str(REPO)],
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        peaks[name] = int(result.stdout.split()[-1])
        path.unlink()
    print(f"peak RSS (MiB): 2 MB corpus {peaks['small']}, 200 MB corpus {peaks['large']}")
    assert peaks["large"] - peaks["small"] < 16, peaks
