"""Paths that almost work: a run's output folder given where a checkpoint is expected resolves to
its newest complete step; a rerun over checkpoints of another model is refused without offering a
flag that could not help."""

import shutil
import sys

import pytest
from helpers import REPO
from omegaconf import OmegaConf

from trainer import build_model
from trainer.checkpoint.folders import CheckpointError, newest_step
from trainer.checkpoint.rerun import check_rerun
from trainer.checkpoint.state import save_weights
from trainer.config.schema import CheckpointConfig
from trainer.errors import ConfigError
from trainer.optim.spec import state_change

sys.path.insert(0, str(REPO / "scripts"))
import convert_hf  # noqa: E402


def test_a_run_folder_resolves_to_its_newest_complete_step(tmp_path, capsys):
    model = build_model("llama_debug", seed=0)
    for step in (2, 4, 6):
        save_weights(model.config, dict(model.state_dict()),
                     tmp_path / "run" / "checkpoints" / f"step_{step}")
    # a save that never finished
    (tmp_path / "run" / "checkpoints" / "step_6" / "manifest.json").unlink()
    said = []
    for given in (tmp_path / "run", tmp_path / "run" / "checkpoints"):
        newest = newest_step(given, "checkpoint.resume", said.append)
        assert newest == tmp_path / "run" / "checkpoints" / "step_4"
    assert said[-1] == (f"checkpoint: checkpoint.resume={tmp_path / 'run' / 'checkpoints'} is a "
                        "run's folder: its newest complete step is "
                        f"{tmp_path / 'run' / 'checkpoints' / 'step_4'}")
    step = tmp_path / "run" / "checkpoints" / "step_2"
    assert newest_step(step, "checkpoint.initial", said.append) == step  # a checkpoint is itself
    convert_hf.to_hf(tmp_path / "run", tmp_path / "hf", None, "bfloat16", "5GB")
    assert ("its newest complete step is" in capsys.readouterr().out
            and (tmp_path / "hf" / "config.json").is_file())
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "step_2")
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "step_4")
    with pytest.raises(CheckpointError, match=r"is a run's folder with no complete checkpoint"):
        newest_step(tmp_path / "run", "checkpoint.resume", said.append)


def test_a_rerun_over_another_models_checkpoints_offers_no_flag(tmp_path):
    model = build_model("llama_debug", seed=0)
    save_weights(model.config, dict(model.state_dict()), tmp_path / "checkpoints" / "step_2")
    config = {"model": {"dim": 256, "name": "llama_debug"}, "training": {"lr": 1e-3}}
    OmegaConf.save(OmegaConf.create(config), tmp_path / "config.yaml")
    resume = CheckpointConfig(enabled=True)
    with pytest.raises(ConfigError,
                       match=r"trained with other settings \(training.lr=0.001 -> 0.002\).*"
                             r"checkpoint.allow_config_change=true"):
        check_rerun({**config, "training": {"lr": 2e-3}}, resume, str(tmp_path))
    with pytest.raises(ConfigError,
                       match=r"holds checkpoints of another model \(model.dim=256 -> 512\), which "
                             r"cannot be resumed with this one; choose another output_dir") as e:
        check_rerun({**config, "model": {"dim": 512, "name": "llama_debug"}}, resume, str(tmp_path))
    assert "allow_config_change" not in str(e.value)
    # LoRA's adapters at another rank are another shape too; their alpha only another setting
    lora = {**config, "peft": {"method": "lora", "rank": 16, "alpha": 16.0}}
    OmegaConf.save(OmegaConf.create(lora), tmp_path / "config.yaml")
    with pytest.raises(ConfigError, match=r"another model \(peft.rank=16 -> 8\), which cannot"):
        check_rerun({**lora, "peft": {"method": "lora", "rank": 8, "alpha": 16.0}}, resume,
                    str(tmp_path))
    with pytest.raises(ConfigError, match=r"other settings \(peft.alpha=16.0 -> 32.0\)"):
        check_rerun({**lora, "peft": {"method": "lora", "rank": 16, "alpha": 32.0}}, resume,
                    str(tmp_path))


def test_more_steps_on_a_resumed_run_says_how_the_schedule_changes(tmp_path):
    model = build_model("llama_debug", seed=0)
    save_weights(model.config, dict(model.state_dict()), tmp_path / "checkpoints" / "step_6")
    config = {"training": {"steps": 10, "lr": 1e-3, "warmup_steps": 2},
              "optim": {"min_lr_ratio": 0.1}}
    OmegaConf.save(OmegaConf.create(config), tmp_path / "config.yaml")
    resume = CheckpointConfig(enabled=True)
    assert check_rerun(config, resume, str(tmp_path)) is None
    longer = {**config, "training": {**config["training"], "steps": 20}}
    assert check_rerun(longer, resume, str(tmp_path)) == (
        "schedule: training.steps 10 -> 20 re-plans the cosine decay to end at step 20: the "
        "learning rate after the newest checkpoint (step 6) goes from 0.00055 (as planned) to "
        "0.000895")


def test_a_run_saved_before_the_optimizers_had_keys_of_their_own_resumes(tmp_path):
    """Every optim section held Muon's keys; an AdamW run's config.yaml with them at their defaults
    resumes as before, and one trained with another optimizer cannot."""
    model = build_model("llama_debug", seed=0)
    save_weights(model.config, dict(model.state_dict()), tmp_path / "checkpoints" / "step_2")
    earlier = {"name": "adamw", "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "min_lr_ratio": 0.1,
               "momentum": 0.95, "nesterov": True, "ns_steps": 5, "ns_dtype": "auto",
               "muon": {"rms_match": "match_rms_adamw"}}
    OmegaConf.save(OmegaConf.create({"optim": earlier}), tmp_path / "config.yaml")
    resume = CheckpointConfig(enabled=True)
    saved = {"optim": {"name": "adamw", "min_lr_ratio": 0.1}}
    assert check_rerun(saved, resume, str(tmp_path)) is None
    with pytest.raises(ConfigError,
                       match=r"holds checkpoints trained with optim.name=adamw, whose optimizer "
                             r"state optim.name=muon cannot take; choose another output_dir"):
        check_rerun({"optim": {"name": "muon"}}, resume, str(tmp_path))
    # float8's blocks are not fp32 moments (bfloat16 ones are: a cast)
    assert check_rerun({"optim": {"name": "adamw", "state_dtype": "bfloat16"}},
                       CheckpointConfig(enabled=True, allow_config_change=True),
                       str(tmp_path)) is None
    with pytest.raises(ConfigError,
                       match=r"holds checkpoints trained with optim.state_dtype=float32, whose "
                             r"moments optim.state_dtype=float8 cannot take; choose another"):
        check_rerun({"optim": {"name": "adamw", "state_dtype": "float8"}}, resume, str(tmp_path))
    # Muon's bfloat16 state keeps a step count for each matrix: no cast from or to float32
    assert state_change({"optim.name": "muon"},
                        {"optim.name": "muon", "optim.state_dtype": "bfloat16"}) is not None
