"""trainer-run's check before any rank starts: the mistakes its ranks would find first about the
output folder and the checkpoint resumed are one `config error:` line and exit status 2 there (the
ranks, under plain torchrun, make the same checks)."""

import fcntl

import pytest
from omegaconf import OmegaConf
from test_ownership import published

from trainer.checkpoint.folders import ADAPTER_CONFIG
from trainer.checkpoint.rerun import TRAINED_CONFIG
from trainer.checks.overrides import compose
from trainer.errors import ConfigError
from trainer.run import launcher
from trainer.run.job import check_data, job_and_config, read_first

BASE = ("model=llama_debug", "+smoke=cpu", "checkpoint.enabled=true")


def trainer_run(capsys, *overrides: str, nnodes: str = "1") -> str:
    """trainer-run's stderr for a job it refuses before launch (exit status 2)."""
    with pytest.raises(SystemExit) as stopped:
        launcher.main(["--standalone", f"--nnodes={nnodes}", "--nproc_per_node=2", "train.py",
                       *BASE, *overrides])
    assert stopped.value.code == 2
    return capsys.readouterr().err


def a_run(out, *overrides: str, steps=(1, 2)) -> list:
    """Checkpoints of steps `steps` in `out`, as a run of `overrides` saves them (each with the
    config it trained with)."""
    _, config = job_and_config(compose([*BASE, *overrides, f"output_dir={out}"]))
    return [published(out / "checkpoints", step, "A", config) for step in steps]


def truncate(checkpoint) -> None:
    data = checkpoint / "shard.distcp"
    data.write_bytes(data.read_bytes()[:10])


def test_a_rerun_at_other_settings_is_refused_before_launch(tmp_path, capsys):
    a_run(tmp_path)
    said = trainer_run(capsys, "training.lr=0.01", f"output_dir={tmp_path}")
    assert said == (f"config error: output_dir={tmp_path} holds checkpoints trained with other "
                    "settings (training.lr=0.001 -> 0.01); choose another output_dir, or set "
                    "checkpoint.allow_config_change=true to resume them with these\n")


def test_a_damaged_checkpoint_is_refused_before_launch_by_name_or_all_of_them(tmp_path, capsys):
    steps = a_run(tmp_path / "run")
    truncate(steps[1])
    said = trainer_run(capsys, f"checkpoint.resume={steps[1]}", f"output_dir={tmp_path / 'b'}")
    assert said == (f"config error: checkpoint.resume={steps[1]} cannot be loaded: shard.distcp "
                    "is 10 bytes, the manifest says 64\n")
    truncate(steps[0])  # every one damaged: resume=auto refuses rather than start afresh
    said = trainer_run(capsys, f"output_dir={tmp_path / 'run'}")
    assert said.startswith("config error: checkpoint.resume=auto: every checkpoint is damaged (")
    assert said.count("\n") == 1 and "checkpoint.resume=none" in said
    # a run's folder with no whole checkpoint, named
    said = trainer_run(capsys, f"checkpoint.resume={tmp_path / 'run'}",
                       f"output_dir={tmp_path / 'b'}")
    assert "is a run's folder with no complete checkpoint" in said


def test_lora_resumed_at_another_rank_is_refused_before_launch(tmp_path, capsys):
    lora = ("peft.method=lora", "peft.rank=16")
    (step,) = a_run(tmp_path / "run", *lora, steps=(1,))
    config = OmegaConf.load(step / TRAINED_CONFIG)
    OmegaConf.save(OmegaConf.create({**OmegaConf.to_container(config.peft), "base": None}),
                   step / ADAPTER_CONFIG)
    said = trainer_run(capsys, "peft.method=lora", "peft.rank=8", f"checkpoint.resume={step}",
                       f"output_dir={tmp_path / 'b'}")
    assert said == (f"config error: checkpoint.resume={step} holds adapters of another shape "
                    "(peft.rank=16 -> 8): resume it with the peft keys it trained with\n")
    said = trainer_run(capsys, "peft.method=lora", "peft.rank=8", f"output_dir={tmp_path / 'run'}")
    assert "holds checkpoints of another model (peft.rank=16 -> 8)" in said


def test_an_output_dir_in_use_is_refused_before_launch_on_one_node(tmp_path, capsys):
    (tmp_path / ".lock").write_text("host h, pid 1, started today")
    with open(tmp_path / ".lock") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        said = trainer_run(capsys, f"output_dir={tmp_path}")
        assert said == (f"config error: output_dir={tmp_path} is in use by another job (host h, "
                        "pid 1, started today): stop it, or choose another output_dir\n")
        # of several nodes, the ranks' lock decides (a late node would find the job's own)
        launcher.check_job_args([*BASE, f"output_dir={tmp_path}"], None, 2)



def test_data_that_holds_no_text_is_refused_before_launch(tmp_path, monkeypatch):
    """trainer-run reads local files and token files first, in a process of its own (here, this
    one): what the ranks would find there is one line before launch."""
    monkeypatch.setenv("TRAINER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("RANK", "0")  # (the check sets it: it is no rank)
    rows = tmp_path / "numbers.jsonl"
    rows.write_text("".join(f'{{"text": {n}}}\n' for n in range(20)))
    job, _ = job_and_config(compose([*BASE, "data.source=json", f"data.path={rows}"]))
    assert read_first(job)
    with pytest.raises(ConfigError, match=r"^data.text_field=text of .*numbers.jsonl holds no "
                       r"text: its values are numbers, not strings$"):
        check_data(job)
    (tmp_path / "ok.txt").write_text("a text of some words, long enough for a window or two. " * 40)
    check_data(job_and_config(compose([*BASE, "data.source=text",
                                       f"data.path={tmp_path / 'ok.txt'}"]))[0])
    assert list((tmp_path / "cache" / "tokens").glob("*.bin"))  # made for the ranks
    assert not read_first(job_and_config(compose(list(BASE)))[0])  # the embedded text: nothing
