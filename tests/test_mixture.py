"""Weighted mixtures (data.mix): each source's share of the trained tokens follows its weight, the
same in every layout and for every seed-and-position, and bad mixtures are config errors."""

import pytest
import torch
from helpers import launch

from trainer.checks.job import check_data
from trainer.config.schema import DataConfig, MixSource
from trainer.data import BatchLoader, build_dataset
from trainer.errors import ConfigError

# Three sources of disjoint alphabets, so each window tells which source it came from.
ALPHABETS = ("abcdefgh", "ijklmnop", "qrstuvwx")


def sources(folder, sizes=(40, 7, 300)) -> list[str]:
    """Text files of words from each alphabet (very different sizes: the small one repeats)."""
    paths = []
    for alphabet, docs in zip(ALPHABETS, sizes):
        (folder / alphabet).mkdir(parents=True)
        for d in range(docs):
            words = " ".join(alphabet[(d + i) % 8] * (1 + (d * i) % 5) for i in range(30))
            (folder / alphabet / f"{d}.txt").write_text(words)
        paths.append(str(folder / alphabet / "*.txt"))
    return paths


def mixture(folder, weights, **data) -> DataConfig:
    mix = [MixSource(source="text", path=path, weight=w)
           for path, w in zip(sources(folder), weights)]
    return DataConfig(mix=mix, cache_dir=str(folder / "cache"), **data)


def source_of(window: torch.Tensor) -> int:
    letters = {chr(t) for t in window.tolist() if chr(t).isalpha()}
    (source,) = {i for i, alphabet in enumerate(ALPHABETS) if letters & set(alphabet)}
    return source


def test_each_source_gets_its_weight_of_the_trained_tokens(tmp_path):
    """Over 200 steps of 8 windows on 2 data-parallel ranks, each source's share of the windows (all
    of seq_len tokens) is within 2% of its weight; the small source goes round many epochs for
    it."""
    weights = (0.5, 0.3, 0.2)
    data = build_dataset(mixture(tmp_path, weights), seq_len=16, seed=0)
    loaders = [BatchLoader(data, global_batch=8, dp_rank=r, dp_size=2, grad_accum=1, seed=0)
               for r in range(2)]
    counts = [0, 0, 0]
    for step in range(200):
        for loader in loaders:
            ((inputs, labels),) = loader.microbatches(step)
            for window in torch.cat([inputs, labels[:, -1:]], dim=1):
                counts[source_of(window)] += 1
    shares = [c / sum(counts) for c in counts]
    print("shares of trained tokens over 200 steps:", [f"{s:.4f}" for s in shares], "weights",
          weights)
    assert all(abs(share - w) <= 0.02 for share, w in zip(shares, weights)), shares
    assert counts[1] > 10 * len(data.streams[1].dataset)  # the small source, read over and over


def test_a_mixture_is_deterministic_and_seeded(tmp_path):
    config = mixture(tmp_path, (2, 1, 1))
    first, again = (build_dataset(config, seq_len=16, seed=0) for _ in range(2))
    batch = [BatchLoader(d, 8, 0, 1, 1, seed=0).microbatches(3)[0][0] for d in (first, again)]
    assert torch.equal(*batch)
    loader = BatchLoader(build_dataset(config, seq_len=16, seed=1), 8, 0, 1, 1, seed=1)
    other = loader.microbatches(3)[0][0]
    assert not torch.equal(batch[0], other)
    # Validation mixes each source's held-out windows.
    val = build_dataset(config, seq_len=16, seed=0, split="val")
    assert {source_of(w) for w in val.take(range(40))} == {0, 1, 2}


def test_bad_mixtures_are_config_errors(tmp_path):
    paths = sources(tmp_path)
    (tmp_path / "empty.txt").write_text("")
    cases = [
        ([MixSource(path=paths[0], weight=1), MixSource(path=paths[1], weight=0)], {},
         r"data.mix\[1\].weight=0 must be > 0"),
        ([MixSource(path=paths[0], weight=-1)], {}, r"data.mix\[0\].weight=-1 must be > 0"),
        ([MixSource(path=paths[0]), MixSource(path=str(tmp_path / "empty.txt"))], {},
         r"data.mix\[1\]: data.path=.*empty.txt holds 0 tokens, too few"),
        ([MixSource(path=str(tmp_path / "none*.txt"))], {},
         r"data.mix\[0\]: data.path=.*none\*.txt matches no"),
        ([MixSource(path=paths[0])], {"path": paths[1]},
         r"data.path=.* and data.mix exclude each other"),
    ]
    for mix, data, message in cases:
        config = DataConfig(mix=mix, cache_dir=str(tmp_path / "cache"), **data)
        with pytest.raises(ConfigError, match=message):
            check_data(config)  # the keys (every rank, first), then what reading the sources finds
            build_dataset(config, seq_len=16, seed=0)


@pytest.mark.multiprocess
def test_train_reads_a_mixture_from_the_command_line(tmp_path):
    """data.mix given as a Hydra list; a bad weight stops before any rank trains, in one line."""
    paths = sources(tmp_path)
    mix = ",".join(f"{{source:text,path:'{p}',weight:{w}}}" for p, w in zip(paths, (0.5, 0.3, 0)))
    result = launch(1, "model=llama_debug", "+smoke=cpu", f"data.mix=[{mix}]",
                    output_dir=tmp_path / "run")
    assert result.returncode != 0, result.stderr[-2000:]
    said = "config error: data.mix[2].weight=0.0 must be > 0"
    assert said in result.stderr, result.stderr[-2000:]
