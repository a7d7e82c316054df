"""A run deletes and resumes only what it wrote: rotation beside another run's checkpoints, a rerun
held to the settings a checkpoint records (whatever config.yaml says now), an output_dir of a
user's files left byte for byte, every checkpoint damaged refused rather than restarted, and the
converters' outputs never written over a file that is there."""

import hashlib
import json
import sys

import pytest
from helpers import REPO, launch, read_metrics
from omegaconf import OmegaConf

from trainer import build_model
from trainer.checkpoint import folders
from trainer.checkpoint.ownership import (
    SAVE_MARKER,
    clean_unfinished,
    continued_run,
    rotate,
    set_aside_others,
    start_save,
)
from trainer.checkpoint.rerun import TRAINED_CONFIG, check_rerun
from trainer.checkpoint.state import save_weights
from trainer.config.schema import CheckpointConfig
from trainer.errors import ConfigError

sys.path.insert(0, str(REPO / "scripts"))
import prepare_data  # noqa: E402


def published(folder, step: int, run: str | None, config: dict | None = None):
    """A published checkpoint of `run` at `step` (a file of its own; the config it trained with)."""
    tmp = folder / f"step_{step}.tmp"
    tmp.mkdir(parents=True)
    (tmp / "shard.distcp").write_bytes(bytes([step]) * 64)
    if config is not None:
        OmegaConf.save(OmegaConf.create(config), tmp / TRAINED_CONFIG)
    folders.publish(tmp, folder / f"step_{step}", step, 0, 1, run=run)
    return folder / f"step_{step}"


def digest(folder) -> dict[str, str]:
    """Every file under `folder` (its path relative to it) -> its md5."""
    return {str(p.relative_to(folder)): hashlib.md5(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_rotation_deletes_only_the_runs_own_checkpoints_and_never_the_newest(tmp_path):
    folder, said = tmp_path / "checkpoints", []
    others = [published(folder, step, "A") for step in (1, 2)]  # a finished run's
    (folder / "step_7").mkdir()  # a user's folder of that name
    (folder / "step_7" / "notes.txt").write_text("mine")
    before = digest(tmp_path)
    # A run beside them (under fault tolerance, say, nothing is set aside): keep_last=1 keeps its
    # newest and takes nothing else.
    own = published(folder, 5, "B")
    rotate(folder, "B", 1, own)
    assert {k: v for k, v in digest(tmp_path).items() if k in before} == before
    newer = published(folder, 6, "B")
    rotate(folder, "B", 1, newer)
    assert not own.exists() and newer.exists() and all(p.exists() for p in others)
    # A run that starts afresh there sets the other run's checkpoints aside, byte for byte, before
    # its first save; the user's folder, which is no checkpoint, stays where it is.
    set_aside_others(folder, "C", None, said.append)
    assert not any(p.exists() for p in others) and (folder / "step_7" / "notes.txt").is_file()
    aside = sorted(folder.glob("step_*.before-*"))
    assert [p.name.split(".")[0] for p in aside] == ["step_1", "step_2", "step_6"]
    assert digest(aside[0]) == {k.removeprefix("checkpoints/step_1/"): v
                                for k, v in before.items() if k.startswith("checkpoints/step_1/")}
    assert "set aside 3 checkpoints this run does not continue" in said[0]


def test_a_resumed_run_keeps_its_own_and_sets_aside_what_it_skipped(tmp_path):
    folder, said = tmp_path / "checkpoints", []
    kept = [published(folder, step, "A") for step in (2, 4)]
    damaged = published(folder, 6, "A")  # newer than what resume=auto took: it was skipped
    assert continued_run("auto", kept[-1]) == "A"  # a rerun goes on as the run it resumes
    assert continued_run("none", None) != continued_run("none", None)
    assert continued_run("checkpoint/step_4", kept[-1]) != "A"  # an explicit resume branches off
    set_aside_others(folder, "A", kept[-1], said.append)
    assert all(p.exists() for p in kept) and not damaged.exists()
    assert len(list(folder.glob("step_6.damaged-*"))) == 1


def test_only_the_trainers_own_unfinished_saves_are_cleaned(tmp_path):
    said = []
    start_save(tmp_path / "step_3.tmp", "A", said.append)
    (tmp_path / "step_5.tmp").mkdir()
    (tmp_path / "step_5.tmp" / "data.bin").write_bytes(b"a user's")
    clean_unfinished(tmp_path, said.append)
    assert not (tmp_path / "step_3.tmp").exists()
    assert (tmp_path / "step_5.tmp" / "data.bin").read_bytes() == b"a user's"
    assert "left step_5.tmp" in said[-1]
    # A save whose folder is taken by one that is not ours moves it aside, and marks its own.
    start_save(tmp_path / "step_5.tmp", "A", said.append)
    (kept,) = tmp_path.glob("step_5.tmp.kept-*")
    assert (kept / "data.bin").read_bytes() == b"a user's"
    assert (tmp_path / "step_5.tmp" / SAVE_MARKER).read_text() == "A"


def test_a_rerun_is_held_to_the_settings_the_checkpoint_records(tmp_path):
    """config.yaml was overwritten by a run that saved nothing: the checkpoint's own record
    decides."""
    trained = {"model": {"name": "llama_debug"}, "training": {"lr": 1e-3}}
    published(tmp_path / "checkpoints", 2, "A", trained)
    other = {"model": {"name": "llama_debug"}, "training": {"lr": 2e-3}}
    OmegaConf.save(OmegaConf.create(other), tmp_path / "config.yaml")
    resume = CheckpointConfig(enabled=True)
    with pytest.raises(ConfigError, match=r"trained with other settings \(training.lr=0.001 -> "
                                          r"0.002\)"):
        check_rerun(other, resume, str(tmp_path))
    assert check_rerun(trained, resume, str(tmp_path)) is None


def test_a_converters_output_never_replaces_what_is_there(tmp_path):
    model = build_model({"family": "llama", "dim": 32, "n_layers": 1, "n_heads": 2,
                         "n_kv_heads": 2, "vocab_size": 256, "ffn_dim": 64})
    (tmp_path / "out.tmp").mkdir()  # a user's folder beside the output's name
    (tmp_path / "out.tmp" / "notes.txt").write_text("mine")
    (tmp_path / "taken").write_text("a file")
    with pytest.raises(ConfigError, match="taken exists; choose a new path"):
        save_weights(model.config, dict(model.state_dict()), tmp_path / "taken")
    save_weights(model.config, dict(model.state_dict()), tmp_path / "out")
    assert folders.verify(tmp_path / "out") is None
    assert (tmp_path / "out.tmp" / "notes.txt").read_text() == "mine"
    assert (tmp_path / "taken").read_text() == "a file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "out.tmp", "taken"]


def test_prepare_data_refuses_an_output_that_is_there_or_is_its_input(tmp_path):
    (tmp_path / "a.txt").write_text("some text")
    for out, said in ((tmp_path / "a.txt", "is also one of the inputs"),
                      (tmp_path / "b.bin", "b.bin exists")):
        if out.name == "b.bin":
            out.write_bytes(b"earlier tokens")
        with pytest.raises(SystemExit, match=said):
            prepare_data.main([str(tmp_path / "*.txt"), str(out), "--workers", "1"])
    assert (tmp_path / "a.txt").read_text() == "some text"
    assert (tmp_path / "b.bin").read_bytes() == b"earlier tokens"


# The debug model at its smallest, a few steps: each run is a few seconds.
RUN = ("model=llama_debug", "model.dim=32", "model.n_layers=1", "model.n_heads=2",
       "model.n_kv_heads=2", "model.ffn_dim=64", "+smoke=cpu", "training.seq_len=32",
       "training.global_batch_size=2", "checkpoint.enabled=true", "checkpoint.interval=1")


def train(out, *overrides):
    return launch(1, *RUN, *overrides, output_dir=out, timeout=180)


def one_config_error(result) -> str:
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert result.returncode == 2 and len(errors) == 1, result.stdout[-2000:] + result.stderr
    assert errors[0].startswith("config error: ")
    return errors[0]


@pytest.mark.multiprocess
def test_a_new_run_beside_a_finished_one_keeps_its_own_and_never_resumes_the_other(tmp_path):
    out = tmp_path / "run"
    first = train(out, "training.steps=2")
    assert first.returncode == 0, first.stderr[-2000:]
    # Another run in the same folder: resume=none, keep_last=1, another lr.
    second = train(out, "training.steps=1", "training.lr=3e-4", "checkpoint.resume=none",
                   "checkpoint.keep_last=1")
    assert second.returncode == 0, second.stderr[-2000:]
    checkpoints = out / "checkpoints"
    assert folders.verify(checkpoints / "step_1") is None  # its own, kept
    assert sorted(p.name.split(".")[0] for p in checkpoints.glob("step_*.before-*")) == [
        "step_1", "step_2"]  # the first run's, set aside
    assert len(list(out.glob("config.before-*.yaml"))) == 1  # the first run's config, kept
    # A rerun at the first run's settings finds only the second run's checkpoint, and refuses it;
    # at the second run's settings it resumes it.
    refused = one_config_error(train(out, "training.steps=2"))
    assert "training.lr=0.0003 -> 0.001" in refused
    resumed = train(out, "training.steps=2", "training.lr=3e-4", "checkpoint.keep_last=1")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resumed from {checkpoints / 'step_1'} at step 1" in resumed.stdout
    assert [r["step"] for r in read_metrics(out)] == [1, 2]


@pytest.mark.multiprocess
def test_a_users_files_in_output_dir_stay_byte_for_byte_and_lost_checkpoints_are_refused(tmp_path):
    out = tmp_path / "run"
    (out / "checkpoints" / "step_9").mkdir(parents=True)  # not a checkpoint: no manifest
    (out / "checkpoints" / "step_9" / "weights.pt").write_bytes(b"mine")
    (out / "checkpoints" / "step_4.tmp").mkdir()
    (out / "checkpoints" / "step_4.tmp" / "half.bin").write_bytes(b"mine too")
    (out / "notes.txt").write_text("my notes")
    (out / "config.yaml").write_text("mine: true\n")
    (out / "metrics.jsonl").write_text(json.dumps({"step": 1, "mine": True}) + "\n")
    before = digest(out)
    result = train(out, "training.steps=4", "checkpoint.keep_last=1")
    assert result.returncode == 0, result.stderr[-2000:]
    after = digest(out)
    # Moved aside as they were: an earlier config and metrics, and the folder of the name the save
    # of step 4 writes into.
    moved = {"config.yaml": "config.before-*.yaml", "metrics.jsonl": "metrics.before-*.jsonl",
             "checkpoints/step_4.tmp/half.bin": "checkpoints/step_4.tmp.kept-*/half.bin"}
    for name, md5 in before.items():
        if name in moved:
            (aside,) = out.glob(moved[name])
            assert after[str(aside.relative_to(out))] == md5
        else:
            assert after.get(name) == md5, name
    assert sorted(p.name for p in (out / "checkpoints").glob("step_?")) == ["step_4", "step_9"]

    # Every checkpoint of the run damaged: refused, naming them, and nothing in the folder changes.
    for data in (out / "checkpoints" / "step_4").glob("*.distcp"):
        data.write_bytes(data.read_bytes()[:100])
    damaged = digest(out)
    said = one_config_error(train(out, "training.steps=6", "checkpoint.keep_last=1"))
    assert "every checkpoint is damaged" in said and "step_4" in said
    assert "checkpoint.resume=none" in said
    assert {k: v for k, v in digest(out).items() if k != ".lock"} == {
        k: v for k, v in damaged.items() if k != ".lock"}
