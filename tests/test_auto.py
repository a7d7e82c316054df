"""parallel=auto: the layout chosen at launch by the plan's search, keys given on the command line kept."""

import pytest
import torch
import yaml
from helpers import launch
from test_plan import job_of

from trainer.errors import ConfigError
from trainer.plan.auto import auto_device, choose_layout, pinned_keys
from trainer.plan.search import search

TINY = ("model=llama_debug", "+smoke=cpu", "parallel=auto")


def test_the_command_line_pins_what_it_sets():
    assert pinned_keys(["+recipe=llama_tp2", "parallel=auto", "parallel.tp=2", "+training.activation_checkpoint=full",
                        "training.steps=5"]) == {"parallel.tp": "2", "training.activation_checkpoint": "full"}


def test_the_choice_is_the_search_s_first_and_keeps_the_pins():
    job, device = job_of(*TINY), auto_device(torch.device("cpu"), 2)
    chosen_job, chosen, said = choose_layout(job, 2, device, {})
    _, best = search(job, 2, device)[0]
    assert chosen == best and said.startswith("parallel=auto: ") and "runner-up" in said
    assert chosen_job.parallel.tp == best["parallel.tp"] and chosen_job.parallel.pp == best["parallel.pp"]
    pinned = {"parallel.tp": "2", "training.activation_checkpoint": "full"}
    _, kept, _ = choose_layout(job, 2, device, pinned)
    assert kept["parallel.tp"] == 2 and kept["training.activation_checkpoint"] == "full"
    # A recipe's microbatch size would derive the accumulation: the search's choice replaces it.
    elastic, chosen, _ = choose_layout(job_of(*TINY, "training.micro_batch_size=1"), 2, device, {})
    assert elastic.training.micro_batch_size is None and chosen["training.micro_batch_size"] is None
    with pytest.raises(ConfigError, match=r"^parallel=auto: no layout of llama_debug on 2 x cpu with parallel.tp=3 "
                                          r"kept fits"):
        choose_layout(job, 2, device, {"parallel.tp": "3"})


@pytest.mark.multiprocess
def test_a_job_trains_in_the_layout_it_chose_and_records_it(tmp_path):
    result = launch(2, *TINY, "parallel.tp=2", "training.steps=2", output_dir=tmp_path, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "parallel=auto: tp=2 " in result.stdout
    assert "mesh pp=1, dp_replicate=1, dp_shard=1, cp=1, tp=2" in result.stdout
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert saved["parallel"]["auto"] is True and saved["parallel"]["tp"] == 2 and saved["parallel"]["dp_shard"] == 1
