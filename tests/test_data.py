"""The embedded text, the split of each global batch over data-parallel ranks (in any layout, and on
resuming with another data-parallel size), the prefetcher, document masking, the data's config
errors, and training on real text. The sources and tokenizers themselves: test_readers.py."""

import collections
import json
import math
import random
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers import launch, train_metrics

from trainer import build_model
from trainer.checks.job import check_data
from trainer.config.schema import DataConfig
from trainer.data import (
    STREAM_VAL_WINDOWS,
    BatchLoader,
    ByteTokenizer,
    EmbeddedText,
    Mixture,
    Prefetcher,
    build_dataset,
    document_positions,
    sentence,
)
from trainer.data.tokenizer import build_tokenizer
from trainer.errors import ConfigError
from trainer.models.attention import attend_within_documents


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
        loader = loader_for(rank, dp_size, grad_accum, pp_microbatches)
        for inputs, labels in loader.microbatches(step):
            assert torch.equal(inputs[:, 1:], labels[:, :-1])
            pieces.append(inputs.chunk(pp_microbatches))
    # pieces[rank * grad_accum + i][m]: rank's piece m of its microbatch i.
    return torch.cat([pieces[rank * grad_accum + i][m] for i in range(grad_accum)
                      for m in range(pp_microbatches)
                      for rank in range(dp_size)])


# A plain source, and a weighted mixture (of three, small enough that each goes round its epochs).
DATASETS = {
    "embedded": lambda seq_len, size: EmbeddedText(seq_len=seq_len, seed=0, size=size),
    "mixture": lambda seq_len, size: Mixture(
        [EmbeddedText(seq_len, seed, size // k) for seed, k in ((0, 1), (1, 3), (2, 5))],
        [0.5, 0.3, 0.2], seed=4),
}


@pytest.mark.parametrize("kind", DATASETS)
def test_global_batch_does_not_depend_on_the_layout(kind):
    data = DATASETS[kind](16, 40)

    def loader_for(rank, dp_size, grad_accum, pp_microbatches=1):
        return BatchLoader(data, global_batch=8, dp_rank=rank, dp_size=dp_size,
                           grad_accum=grad_accum, seed=1, pp_microbatches=pp_microbatches)

    for step in (0, 3, 7):  # step 7 crosses into the second epoch
        reference = global_batch(loader_for, 1, 1, step)
        assert reference.shape == (8, 16)
        # The same sequences in the same microbatches: 1 rank with 4 microbatches of 2 ...
        by_microbatch = global_batch(loader_for, 1, 4, step)
        assert torch.equal(by_microbatch, reference)
        # ... is 2 ranks accumulating 2, 2 ranks in a 2-microbatch pipeline, or 2 x 2 of each.
        for dp_size, grad_accum, pp_microbatches in ((2, 2, 1), (2, 1, 2), (2, 2, 2)):
            assert torch.equal(global_batch(loader_for, dp_size, grad_accum, step, pp_microbatches),
                               reference)
        for dp_size, grad_accum in ((2, 1), (4, 1), (8, 1)):
            assert torch.equal(global_batch(loader_for, dp_size, grad_accum, step), reference)
    # Ranks read disjoint sequences (windows numbered by their index: short generated texts can
    # repeat), and consecutive steps differ.
    numbered = [torch.full((17,), i) for i in range(40)]
    a, b = (BatchLoader(numbered, global_batch=8, dp_rank=rank, dp_size=2, grad_accum=1,
                        seed=1).microbatches(0)[0][0]
            for rank in (0, 1))
    assert not set(a[:, 0].tolist()) & set(b[:, 0].tolist())
    assert not torch.equal(global_batch(loader_for, 1, 1, 0), global_batch(loader_for, 1, 1, 1))


@pytest.mark.parametrize("kind", DATASETS)
def test_resume_mid_epoch_with_another_data_parallel_size_continues_at_the_same_sample(kind):
    """A run stopped after k steps saved its position (sequences consumed); a loader of any dp size
    that starts there reads the sequences the uninterrupted run would have."""
    data = DATASETS[kind](8, 30)

    def loader_for(rank, dp_size, grad_accum=1, pp_microbatches=1, offset=0):
        loader = BatchLoader(data, global_batch=8, dp_rank=rank, dp_size=dp_size,
                             grad_accum=grad_accum, seed=3, pp_microbatches=pp_microbatches)
        loader.offset = offset
        return loader

    # 64 sequences: 2 epochs and more
    uninterrupted = [global_batch(loader_for, 2, 1, step) for step in range(8)]
    position = loader_for(0, 2).position(steps=2)  # mid-epoch: 16 of 30 sequences read
    def resumed(rank, dp_size, grad_accum, pp_microbatches):
        return loader_for(rank, dp_size, grad_accum, pp_microbatches, offset=position)

    for dp_size in (1, 2, 4):
        for step in range(6):  # on across the epoch boundary
            assert torch.equal(global_batch(resumed, dp_size, 1, step), uninterrupted[2 + step])


def test_prefetcher_computes_the_next_step_in_the_background():
    threads, computed = set(), []

    def batch(step):
        threads.add(threading.current_thread().name)
        computed.append(step)
        return step * 10

    prefetch = Prefetcher(batch)
    assert [prefetch(step) for step in range(3)] == [0, 10, 20]
    time.sleep(0.1)
    # step 3 waits, ready, for its turn
    assert computed == [0, 1, 2, 3] and threads == {"prefetch_0"}
    assert prefetch(7) == 70  # a step out of order is computed then
    prefetch.close()


def test_document_mask_keeps_attention_within_each_document():
    """With documents packed into one sequence, each document's logits are those of the document
    alone: positions restart after each EOS and attention does not cross it."""
    eos = ByteTokenizer.eos_id
    model = build_model("llama_debug")
    a, b = torch.randint(1, 256, (1, 10)), torch.randint(1, 256, (1, 7))
    packed = torch.cat([a, torch.tensor([[eos]]), b], dim=1)
    positions = document_positions(packed, eos)
    assert positions.tolist() == [[*range(11), *range(7)]]
    without = model(packed)
    attend_within_documents(model)
    logits = model(packed, positions)
    torch.testing.assert_close(logits[:, 11:], model(b), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits[:, :11], without[:, :11], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(logits[:, 11:], without[:, 11:], atol=1e-3)


def test_missing_data_path_is_a_config_error(tmp_path):
    import pytest

    with pytest.raises(ConfigError, match="data.path=.*missing.txt matches no readable file"):
        build_dataset(DataConfig(source="text", path=str(tmp_path / "missing.txt")), seq_len=32,
                      seed=0)
    with pytest.raises(ConfigError, match="data.path=.*missing.bin is not a token file"):
        build_dataset(DataConfig(source="binary", path=str(tmp_path / "missing.bin")), seq_len=32,
                      seed=0)
    with pytest.raises(ConfigError,
                       match="data.tokenizer=.*nothing is neither 'bytes' nor a tokenizer.json"):
        build_tokenizer(str(tmp_path / "nothing"))
    # What the keys say without reading anything: the rules every rank checks first.
    with pytest.raises(ConfigError,
                       match=r"data.source=s3 is unknown; choose one of \['embedded', 'text'"):
        check_data(DataConfig(source="s3"))
    with pytest.raises(ConfigError,
                       match="data.path=None must name a Hugging Face dataset for data.source=hub"):
        check_data(DataConfig(source="hub"))
    with pytest.raises(ConfigError,
                       match="data.path=None must name a token file for data.source=binary"):
        check_data(DataConfig(source="binary"))
    with pytest.raises(ConfigError,
                       match=r"data.tokenizer=.*tok.json needs another data.source \(the embedded"):
        check_data(DataConfig(source="embedded", tokenizer=str(tmp_path / "tok.json")))


def write_corpus(folder: Path, n_files: int, docs_per_file: int = 150) -> Path:
    """Text files of English-like documents (the embedded generator's sentences), blank-line
    separated."""
    folder.mkdir()
    for f in range(n_files):
        rng = random.Random(f)
        docs = [" ".join(sentence(rng) for _ in range(rng.randrange(3, 30)))
                for _ in range(docs_per_file)]
        (folder / f"{f}.txt").write_text("\n\n".join(docs))
    return folder


@pytest.mark.multiprocess
def test_training_on_json_rows_with_separate_validation_files(tmp_path):
    """Two ranks train on jsonl rows and validate on other files (validation.path); both losses
    fall."""
    corpus = write_corpus(tmp_path / "corpus", n_files=3, docs_per_file=40)
    for f, name in enumerate(("train_0", "train_1", "val")):
        rows = (corpus / f"{f}.txt").read_text().split("\n\n")
        (corpus / f"{name}.jsonl").write_text("".join(json.dumps({"text": row}) + "\n"
                                                      for row in rows))
    records = train_metrics(2, "+recipe=llama_fsdp", "model=llama_debug", "+smoke=cpu",
                            "data.source=json", f"data.path={corpus}/train_*.jsonl",
                            f"validation.path={corpus}/val.jsonl", "training.seq_len=64",
                            "validation.every=10", "validation.steps=1",
                            output_dir=tmp_path / "run")
    losses, val = [r["loss"] for r in records], [r["val_loss"] for r in records if "val_loss" in r]
    assert (losses[-1] < 0.6 * losses[0] and len(val) == 2 and val[-1] < val[0]
            and val[-1] < 0.6 * losses[0])


@pytest.mark.multiprocess
def test_real_text_validation_loss_falls_well_below_the_unigram_entropy(tmp_path):
    """150 steps of llama_debug on a text corpus: the held-out loss ends far below the entropy of
    the corpus's byte frequencies (what a model that ignores context can reach; measured: 0.39 of
    it)."""
    corpus = write_corpus(tmp_path / "corpus", n_files=4)
    text = b"".join(p.read_bytes() for p in sorted(corpus.glob("*.txt")))
    counts = collections.Counter(text)
    # nats per byte
    unigram_entropy = -sum(c / len(text) * math.log(c / len(text)) for c in counts.values())
    records = train_metrics(1, "model=llama_debug", "+smoke=cpu", "data.source=text",
                            f"data.path={corpus}/*.txt", "training.steps=150",
                            "training.seq_len=64", "training.lr=3e-3", "validation.every=150",
                            "validation.steps=4", "metrics.log_every=50",
                            output_dir=tmp_path / "run")
    val_loss = records[-1]["val_loss"]
    print(f"unigram entropy {unigram_entropy:.3f} nats, validation loss after 150 steps "
          f"{val_loss:.3f}")
    assert val_loss < 0.5 * unigram_entropy


@pytest.mark.parametrize("ranks, overrides, message", [
    (1, ("validation.path=elsewhere/*.txt",),
     "config error: validation.path=elsewhere/*.txt needs files of your own"),
    (1, ("model.vocab_size=200",),
     "config error: model.vocab_size=200 must be >= the tokenizer's 256 (data.tokenizer=bytes)"),
])
@pytest.mark.multiprocess
def test_data_config_errors(ranks, overrides, message, tmp_path):
    result = launch(ranks, "model=llama_debug", "+smoke=cpu", *overrides, output_dir=tmp_path)
    assert result.returncode != 0 and message in result.stderr, result.stderr[-2000:]


@pytest.mark.multiprocess
def test_an_error_only_one_rank_finds_is_still_said(tmp_path):
    """Rank 1's shard of this stream (its odd rows) is all validation documents, rank 0's is not:
    only rank 1 finds the error, and the first rank, which says the errors every rank finds, has
    none to say, so rank 1 says it itself."""
    # more than the validation windows
    long = " ".join(sentence(random.Random(1)) for _ in range(400))
    assert len(long) > 32 * STREAM_VAL_WINDOWS
    (tmp_path / "hub").mkdir()
    rows = ["a short first document", long, "a document rank 0 trains on"]
    (tmp_path / "hub" / "train.jsonl").write_text("".join(json.dumps({"text": t}) + "\n"
                                                          for t in rows))
    result = launch(2, "model=llama_debug", "+smoke=cpu", "data.source=hub",
                    f"data.path={tmp_path}/hub", "training.seq_len=32",
                    "training.global_batch_size=2", output_dir=tmp_path / "run", timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.count("config error:") == 1, result.stderr[-2000:]
    assert ("holds no documents for data-parallel rank 1 of 2 once the validation windows' "
            "documents are held out" in result.stderr), result.stderr[-2000:]
