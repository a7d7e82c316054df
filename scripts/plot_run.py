"""A run's curves as one PNG, or several runs' overlaid: loss (validation loss dashed), gradient
norm, learning rate, tokens/s and rank 0's peak memory against step, each run named in the legend
by its folder, its layout and the config values in which the runs differ.

    python scripts/plot_run.py outputs/llama_fsdp  # writes outputs/llama_fsdp/curves.png
    python scripts/plot_run.py outputs/a outputs/b --out both.png  # two runs on the same axes

Needs matplotlib: pip install -e ".[plot]". Exit 2 on bad input (a folder without metrics.jsonl).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer.observe.compare import Run, read_run  # noqa: E402

# Each panel: its title and the metrics.jsonl keys it draws (the second one dashed).
PANELS = [("loss", ("loss", "val_loss")), ("gradient norm", ("grad_norm",)),
          ("learning rate", ("lr",)), ("tokens/s (whole job)", ("tokens_per_s",)),
          ("peak memory, rank 0 (GiB)", ("mem_gib",)),
          ("slowest rank's step / the median rank's", ("slowest_rank_ratio",))]


# Keys every run has its own value of, saying nothing of what was trained.
NOT_COMPARED = ("output_dir", "run_name", "parallel", "wandb", "metrics", "checkpoint.resume")


def flat(config: dict, prefix: str = "") -> dict:
    """A config's values by dotted key."""
    out = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def names(runs: list[Run]) -> list[str]:
    """Each run's legend name: its folder and layout, and the config values in which the runs differ
    (optim.name=muon beside adamw), so that no two runs read alike."""
    configs = [{k: v for k, v in flat(run.config).items() if not k.startswith(NOT_COMPARED)}
               for run in runs]
    differing = sorted({k for c in configs for k in c
                        if any(c.get(k) != other.get(k) for other in configs)})
    return [f"{run.path.name} ({run.layout})" + "".join(f" {k}={c.get(k)}" for k in differing)
            for run, c in zip(runs, configs)]


def plot(runs: list[Run]):
    """The figure: one panel per PANELS entry, each run a colour."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, grid = plt.subplots(2, 3, figsize=(15, 8), layout="constrained")
    for axis, (title, keys) in zip(grid.flat, PANELS):
        for colour, (run, name) in enumerate(zip(runs, names(runs))):
            for key, style in zip(keys, ("-", "--")):
                points = [(s, row[key]) for s, row in sorted(run.steps.items())
                          if row.get(key) is not None]
                if points:
                    label = name + (f" {key}" if key != keys[0] else "")
                    marker = "." if style == "--" else None  # validation: a few points
                    axis.plot(*zip(*points), style, color=f"C{colour}", label=label, marker=marker)
        axis.set_title(title)
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
        if not axis.lines:  # a figure no run logged (the straggler check on one rank)
            axis.set_axis_off()
    # below the panels, the figure made room for it: inside one, long names ran off its edge
    handles, labels = grid.flat[0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="outside lower center", fontsize="small",
                  ncols=1 if max(map(len, labels)) > 60 else min(len(labels), 4))
    return figure


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="output_dir of each run")
    parser.add_argument("--out",
                        help="the PNG to write (default: curves.png in the first run's folder)")
    args = parser.parse_args(argv)
    try:
        runs = [read_run(path) for path in args.runs]
        import matplotlib  # noqa: F401
    except ValueError as e:
        print(f"plot_run: {e}", file=sys.stderr)
        return 2
    except ImportError:
        print('plot_run: needs matplotlib: pip install -e ".[plot]"', file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else runs[0].path / "curves.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    plot(runs).savefig(out, dpi=100)
    print(f"plot_run: {len(runs)} run(s) -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
