"""The embedded data and the split of each global batch over data-parallel ranks."""

import torch

from trainer.config import DataConfig
from trainer.data import BatchLoader, ByteTokenizer, EmbeddedText, build_dataset
from trainer.errors import ConfigError


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
    assert len(data) == (1200 - 1) // 32
    assert ByteTokenizer().decode(data[0].tolist()).startswith("hello world")


def test_missing_data_path_is_a_config_error(tmp_path):
    import pytest

    with pytest.raises(ConfigError, match="data.path=.*missing.txt is not a readable file"):
        build_dataset(DataConfig(source="text", path=str(tmp_path / "missing.txt")), seq_len=32, seed=0)
    with pytest.raises(ConfigError, match="data.source=hub is unknown"):
        build_dataset(DataConfig(source="hub"), seq_len=32, seed=0)
