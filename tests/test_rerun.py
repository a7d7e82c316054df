"""A rerun into a used output_dir never destroys or misdescribes what is there: a finished run
trains nothing and keeps its config.yaml, a resume with other training settings is refused, a
checkpoint folder is never overwritten (moved aside instead), and metrics.jsonl holds each step
once."""

import hashlib
import importlib.util
import json
import shutil
from pathlib import Path

import pytest
from helpers import launch, read_metrics

RUN = ("model=llama_debug", "+smoke=cpu", "training.seq_len=32", "training.global_batch_size=2",
       "model.n_layers=1", "checkpoint.enabled=true", "checkpoint.interval=2")
TENSORBOARD = importlib.util.find_spec("tensorboard") is not None  # CI installs it (.[tensorboard])
if TENSORBOARD:
    RUN += ("metrics.tensorboard.enabled=true",)


def tensorboard_steps(out: Path) -> dict[str, list[int]]:
    """Each scalar's steps as TensorBoard's own reader shows them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    return {tag: [e.step for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def run(out: Path, *overrides: str):
    result = launch(1, *RUN, *overrides, output_dir=out, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.multiprocess
def test_reruns_keep_what_is_there(tmp_path):
    out = tmp_path / "run"
    run(out, "training.steps=4")
    config = (out / "config.yaml").read_bytes()

    # Finished: the same command trains nothing; with
    # another lr and seed it is refused, naming them.
    again = run(out, "training.steps=4")
    assert "nothing to train: already at step 4 (training.steps=4)" in again.stdout
    changed = launch(1, *RUN, "training.steps=4", "training.lr=3e-4", "training.seed=7",
                     output_dir=out, timeout=180)
    assert changed.returncode == 2, changed.stderr[-2000:]
    assert changed.stderr.count("config error:") == 1, changed.stderr[-2000:]
    assert "training.lr=0.001 -> 0.0003, training.seed=0 -> 7" in changed.stderr
    assert "Traceback" not in changed.stderr
    # Another optimizer cannot take the saved state,
    # whatever the flags: its weights can start a new run.
    switched = launch(1, *RUN, "training.steps=4", "optim=muon",
                      "checkpoint.allow_config_change=true", output_dir=out, timeout=180)
    assert switched.returncode == 2, switched.stderr[-2000:]
    assert switched.stderr.count("config error:") == 1, switched.stderr[-2000:]
    assert (f"optim.name=muon cannot take; choose another output_dir and start from their weights "
            f"with checkpoint.initial={out / 'checkpoints' / 'step_4'}" in switched.stderr)
    assert (out / "config.yaml").read_bytes() == config
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4]

    # Resumed further: each step once in metrics.jsonl.
    run(out, "training.steps=6")
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4, 5, 6]
    # Resumed from step 4 after steps 5 and 6 were logged (their checkpoint lost): each step once,
    # the second run's, in metrics.jsonl and in TensorBoard, every scalar of the record there.
    shutil.rmtree(out / "checkpoints" / "step_6")
    run(out, "training.steps=6")
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4, 5, 6]
    if TENSORBOARD:
        steps = tensorboard_steps(out)
        last = read_metrics(out)[-1]
        numeric = {k for k, v in last.items() if isinstance(v, (int, float))
                   and k not in ("step", "time")}
        assert numeric <= steps.keys() and "loss" in steps, (numeric, steps.keys())
        assert all(s == [1, 2, 3, 4, 5, 6] for s in steps.values()), steps

    # Checkpoints without their manifests are skipped by resume=auto, and the fresh run's saves of
    # the same steps move them aside, byte for byte; the earlier metrics go aside too.
    checkpoints = out / "checkpoints"
    for step in checkpoints.glob("step_*"):
        (step / "manifest.json").unlink()
    before = {p.name: digest(p) for p in checkpoints.glob("step_*")}
    fresh = run(out, "training.steps=6")
    assert fresh.stdout.count("skipping") >= 3, fresh.stdout[-3000:]
    for name, files in before.items():
        (aside,) = checkpoints.glob(f"{name}.replaced-*")
        assert digest(aside) == files
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4, 5, 6]
    (old,) = out.glob("metrics.before-*.jsonl")
    assert [json.loads(line)["step"] for line in old.read_text().splitlines()] == [1, 2, 3, 4, 5, 6]
    if TENSORBOARD:  # the fresh run's curves alone; the earlier ones aside
        assert all(s == [1, 2, 3, 4, 5, 6] for s in tensorboard_steps(out).values())
        assert len(list(out.glob("tensorboard.before-*"))) == 1
