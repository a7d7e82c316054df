"""Composition: recipes, group overrides, the smoke preset, and errors for bad keys or names."""


import pytest
from helpers import REPO, run_script
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from trainer.checks.overrides import check_overrides, compose_job, job_config, renamed
from trainer.config.files import CONFIG_DIR, RECIPE_DIR, register_configs
from trainer.errors import ConfigError

register_configs()


def composed(*overrides: str):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_recipe_sets_layout_and_command_line_wins():
    cfg = composed("+recipe=llama_hsdp", "model=llama_debug", "training.steps=7")
    assert cfg.parallel.dp_replicate == 2 and cfg.parallel.dp_shard == -1
    assert cfg.model.name == "llama_debug"  # the group override beats the recipe's llama3_8b
    assert cfg.training.steps == 7


def test_recipe_alone_picks_a_real_model_size():
    assert composed("+recipe=llama_fsdp").model.name == "llama3_8b"


def test_smoke_keeps_layout_and_shrinks_the_run():
    cfg = composed("+recipe=llama_hsdp", "model=llama_debug", "+smoke=cpu")
    assert cfg.parallel.dp_replicate == 2
    t = cfg.training
    assert (cfg.device, t.steps, t.seq_len, t.global_batch_size) == ("cpu", 20, 128, 8)
    assert cfg.metrics.log_every == 1


def test_every_recipe_composes():
    for path in RECIPE_DIR.glob("*.yaml"):
        job_config(composed(f"+recipe={path.stem}"))


# The recipes' rank counts: each recipe, with its real model size, is a valid layout there.
RECIPE_WORLDS = {"llama_fsdp": 8, "llama_hsdp": 8, "llama_tp2": 4, "llama_tp2_pp4": 8,
                 "llama_pp_interleaved": 4, "llama_cp2": 4, "llama_4d": 16, "mixtral_ep": 4,
                 "mixtral_ep2_tp2": 8, "qwen3_tp2": 4, "qwen3_moe_ep": 4, "deepseek_v3_ep": 256}


@pytest.mark.parametrize("recipe", RECIPE_WORLDS)
def test_recipe_is_a_valid_layout_at_its_world_size(recipe):
    from trainer.checks.job import check_job

    check_job(job_config(composed(f"+recipe={recipe}")), world=RECIPE_WORLDS[recipe])


def test_misspelt_key_and_wrong_type_fail_naming_the_key():
    with pytest.raises(Exception, match="stepz"):
        composed("training.stepz=3")
    with pytest.raises(Exception, match="steps"):
        composed("training.steps=many")


def test_unknown_group_choice_is_a_config_error():
    with pytest.raises(ConfigError, match=r"model=llama_huge is not a known model"):
        check_overrides(["model=llama_huge"])
    with pytest.raises(ConfigError, match=r"recipe=nope is not a known recipe"):
        check_overrides(["+recipe=nope"])
    # a misspelling is told the name it is close to, and only that
    with pytest.raises(ConfigError, match=r"model=qwen3_8 is not a known model; did you mean "
                                          r"model=qwen3_8b\?$"):
        check_overrides(["model=qwen3_8"])
    check_overrides(["+recipe=llama_fsdp", "model=llama_debug", "training.steps=3"])


def test_unknown_keys_are_refused_even_with_plus_and_near_ones_named():
    for arg in ("training.stepz=5", "+training.stepz=5", "++training.stepz=5"):
        with pytest.raises(ConfigError,
                           match=r"^training.stepz is not a config key; did you mean "
                                 r"training.steps\?"):
            check_overrides([arg])
    with pytest.raises(ConfigError,
                       match=r"^modle.dim is not a config key; did you mean model.dim"):
        check_overrides(["modle.dim=8"])
    with pytest.raises(ConfigError,
                       match=r"^zzz is not a config key; see `python train.py --cfg job`"):
        check_overrides(["+zzz=1"])
    # The section and the name each alike (not the whole string: val.path was data.path), and a
    # known name under another section first.
    for typed, meant in (("val.path", "validation.path"), ("validaton.pth", "validation.path"),
                         ("training.lr_rate", "training.lr")):
        with pytest.raises(ConfigError,
                           match=rf"^{typed} is not a config key; did you mean {meant}\?"):
            check_overrides([f"{typed}=1"])
    # An optim key is its optimizer's, checked once composed: the same suggestion
    with pytest.raises(ConfigError,
                       match=r"^optim.lr is not a config key \(of optim.name=adamw\); did you mean "
                             r"training.lr\?"):
        compose_job(["optim.lr=1"])
    # Nested sections, a list of mappings, Hydra's own keys and flags pass.
    check_overrides(["model.rope_scaling.factor=2", "metrics.wandb.enabled=true",
                     "checkpoint.async_save=true", "training.spike.threshold=3", "data.mix=[]",
                     "imports=[x]", "hydra.run.dir=.", "--cfg", "job", "~model.rope_scaling"])


def test_a_renamed_key_still_works_for_one_release_with_a_notice():
    args, notices = renamed(["+recipe=llama_fsdp", "checkpoint.async=true",
                             "checkpoint.enabled=true"])
    assert args == ["+recipe=llama_fsdp", "checkpoint.async_save=true", "checkpoint.enabled=true"]
    assert notices == ["config: checkpoint.async is now checkpoint.async_save; the old spelling "
                       "goes in the next release"]
    assert compose_job(["checkpoint.async=true"]).checkpoint.async_save is True


@pytest.mark.multiprocess
def test_print_config_without_running():
    result = run_script(REPO / "train.py", "+recipe=llama_fsdp", "--cfg", "job")
    assert result.returncode == 0, result.stderr
    printed = OmegaConf.create(result.stdout)
    assert printed.parallel.dp_shard == -1 and printed.model.name == "llama3_8b"


def test_llama_3_1_rotary_scaling_composes_and_bad_values_are_config_errors():
    from trainer.checks.job import check_model
    from trainer.checks.ranges import check_ranges

    model = job_config(composed("model=llama3_2_1b")).model
    check_model(model)
    scaling = model.rope_scaling
    assert (scaling.factor, scaling.original_max_seq_len, model.max_seq_len) == (32.0, 8192, 131072)
    for override, message in (("type=ntk", "model.rope_scaling.type=ntk is not supported"),
                              ("low_freq_factor=4.0",
                               "low_freq_factor=4.0 must be > 0 and below high_freq_factor"),
                              ("factor=0.5", "model.rope_scaling.factor=0.5 must be >= 1")):
        job = job_config(composed("model=llama3_2_1b", f"model.rope_scaling.{override}"))
        with pytest.raises(ConfigError, match=message):
            check_ranges(job)
            check_model(job.model)
