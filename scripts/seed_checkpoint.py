"""Writes a model's initial weights once, as a checkpoint that any layout can start from.

    python scripts/seed_checkpoint.py OUT [--model llama_debug] [--seed 0]
    torchrun ... train.py +recipe=NAME checkpoint.initial=OUT

The trainer's own initialisation is already layout-independent; a seed checkpoint pins the
weights across code changes, model families' init schemes, and runs with different seeds.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer.checkpoint import save_weights  # noqa: E402
from trainer.errors import ConfigError  # noqa: E402
from trainer.models import build_model, model_config  # noqa: E402


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--model", default="llama_debug",
                        help="a model config name (configs/model/NAME.yaml)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        cfg = model_config(args.model)
        save_weights(cfg, build_model(cfg, seed=args.seed).state_dict(), args.out)
    except ConfigError as e:
        sys.exit(f"error: {e}")
    print(f"wrote the initial weights of {cfg.name} (seed {args.seed}) to {args.out}")


if __name__ == "__main__":
    main(sys.argv[1:])
