"""Stage splitting and placement for pipeline parallel."""

import torch

from trainer import build_model
from trainer.models import family
from trainer.parallel.pipeline import keep_modules, split_modules, stage_ids

LLAMA = family("llama")


def split(n_layers: int, n_stages: int, embedding_cost: float,
          output_cost: float) -> list[list[str]]:
    layers = [LLAMA.block_name(i) for i in range(n_layers)]
    return split_modules("tok_embeddings", layers, ["norm", "output"], n_stages, embedding_cost,
                         output_cost)


def test_split_balances_layers_with_embedding_and_head_as_layer_equivalents():
    stages = split(8, 4, embedding_cost=1.0, output_cost=1.0)
    assert stages == [
        ["tok_embeddings", "layers.0"], ["layers.1", "layers.2"],
        ["layers.3", "layers.4", "layers.5"], ["layers.6", "layers.7", "norm", "output"],
    ]
    assert split(8, 4, 0.0, 0.0)[0] == ["tok_embeddings", "layers.0", "layers.1"]
    # As many stages as layers: every stage still gets exactly one layer.
    assert [sum(n.startswith("layers.") for n in s) for s in split(8, 8, 1.0, 1.0)] == [1] * 8


def test_stage_placement():
    assert stage_ids(1, pp=4, per_rank=1, schedule="1f1b") == [1]
    assert stage_ids(1, pp=4, per_rank=2, schedule="interleaved_1f1b") == [1, 5]
    assert stage_ids(1, pp=4, per_rank=2, schedule="zbv") == [1, 6]
    # pp=1 (no pipeline): whatever the schedule says, the rank holds the one whole model.
    for schedule in ("zbv", "dualpipev", "interleaved_1f1b"):
        assert stage_ids(0, pp=1, per_rank=1, schedule=schedule) == [0]


def test_stages_chained_equal_the_whole_model():
    whole = build_model("llama_debug", seed=0)
    units = LLAMA.pipeline_units(8)
    stages = [keep_modules(build_model("llama_debug", seed=0), units, names)
              for names in split(8, 3, 1.0, 1.0)]
    assert stages[1].tok_embeddings is None and stages[0].output is None
    names = {n for s in stages for n, _ in s.named_parameters()}
    assert names == {n for n, _ in whole.named_parameters()}
    tokens = torch.randint(0, 2048, (2, 12))
    h = tokens
    for stage in stages:
        h = stage(h)
    torch.testing.assert_close(h, whole(tokens))
