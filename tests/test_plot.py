"""scripts/plot_run.py: one PNG of a run's curves, or of several runs overlaid."""

import json
import sys

import pytest
import yaml
from helpers import REPO, needs

sys.path.insert(0, str(REPO / "scripts"))
import plot_run  # noqa: E402

from trainer.observe.compare import read_run  # noqa: E402

NEEDS_MATPLOTLIB = needs("matplotlib", "plot")
# matplotlib's first plot on a machine builds its font
# cache, which runs one `fc-list`: a tool's command.
BUILDS_FONT_CACHE = pytest.mark.tool


def write_run(path, scale=1.0, parallel=None, world=1, **config):
    path.mkdir(parents=True)
    rows = [{"step": s, "loss": scale * 8 / s, "grad_norm": 3.0, "lr": 1e-3 * min(1, s / 3),
             "tokens_per_s": 900.0 + s, "mem_gib": 0.5, "world_size": world,
             **({"val_loss": scale * 8.5 / s} if s % 5 == 0 else {})}
            for s in range(1, 21)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (path / "config.yaml").write_text(yaml.safe_dump({"device": "cpu", "parallel": parallel or {},
                                                      "output_dir": str(path), **config}))
    return path


@NEEDS_MATPLOTLIB
@BUILDS_FONT_CACHE
def test_one_run_is_a_png_of_its_panels(tmp_path, capsys):
    from PIL import Image

    run = write_run(tmp_path / "smoke")
    assert plot_run.main([str(run)]) == 0
    with Image.open(run / "curves.png") as image:
        assert image.format == "PNG" and image.size == (1500, 800)
    figure = plot_run.plot([read_run(run)])
    titles = [axis.get_title() for axis in figure.axes if axis.axison]
    assert titles == [title for title, _ in plot_run.PANELS[:5]]  # no straggler figure on one rank
    labels = [line.get_label() for line in figure.axes[0].lines]
    assert labels == ["smoke (one process)", "smoke (one process) val_loss"]


@NEEDS_MATPLOTLIB
@BUILDS_FONT_CACHE
def test_several_runs_share_the_axes_named_by_their_layouts(tmp_path):
    a = write_run(tmp_path / "fsdp", parallel={"dp_shard": -1, "tp": 1}, world=4)
    b = write_run(tmp_path / "tp2", 1.01, parallel={"dp_shard": -1, "tp": 2}, world=4)
    out = tmp_path / "plots" / "both.png"  # (a folder not there yet)
    assert plot_run.main([str(a), str(b), "--out", str(out)]) == 0 and out.stat().st_size > 10_000
    figure = plot_run.plot([read_run(a), read_run(b)])
    labels = [line.get_label() for line in figure.axes[1].lines]
    assert labels == ["fsdp (dp_shard=4)", "tp2 (dp_shard=2 tp=2)"]
    # Runs of one layout apart in their config are named by what differs (their folders aside).
    adamw = write_run(tmp_path / "x" / "run", optim={"name": "adamw", "lr_ratio": 0.1})
    muon = write_run(tmp_path / "y" / "run", optim={"name": "muon", "lr_ratio": 0.1})
    figure = plot_run.plot([read_run(adamw), read_run(muon)])
    labels = [line.get_label() for line in figure.axes[1].lines]
    assert labels == ["run (one process) optim.name=adamw", "run (one process) optim.name=muon"]


def test_a_folder_without_metrics_is_one_line_and_exit_2(tmp_path, capsys):
    assert plot_run.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err == f"plot_run: {tmp_path} has no metrics.jsonl: not a run's output_dir\n"


@NEEDS_MATPLOTLIB
@BUILDS_FONT_CACHE
def test_the_legend_lies_inside_the_figure_however_long_the_names(tmp_path):
    keys = {"optim": {"name": "adamw", "beta2": 0.95, "state_dtype": "float32"},
            "training": {"lr": 0.001, "warmup_steps": 2, "seq_len": 128}}
    other = {"optim": {"name": "muon", "beta2": 0.999, "state_dtype": "bfloat16"},
             "training": {"lr": 0.003, "warmup_steps": 20, "seq_len": 256}}
    runs = [read_run(write_run(tmp_path / name, **config))
            for name, config in (("a_run_with_a_long_name", keys), ("b", other))]
    figure = plot_run.plot(runs)
    figure.canvas.draw()
    (legend,) = figure.legends
    box, page = legend.get_window_extent(), figure.bbox
    assert len(legend.get_texts()) == 4  # each run's loss and val_loss
    assert page.x0 <= box.x0 and box.x1 <= page.x1 and page.y0 <= box.y0 and box.y1 <= page.y1
