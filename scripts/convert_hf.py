"""Converts between Hugging Face directories and this trainer's checkpoints.

    python scripts/convert_hf.py from-hf HF_DIR OUT [--model NAME]   # OUT: usable as checkpoint.initial
    python scripts/convert_hf.py to-hf CKPT OUT [--model NAME]       # OUT: loads with AutoModelForCausalLM

CKPT is any checkpoint of ours (a training checkpoint in any layout, a seed or a converted one).
--model names one of configs/model/ to check the weights against (from-hf) or to use when CKPT
holds no model.yaml (to-hf). Local directories only; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer.checkpoint.files import MODEL_CONFIG  # noqa: E402
from trainer.checkpoint.state import check_model, load_weights, save_weights, saved_config  # noqa: E402
from trainer.errors import ConfigError  # noqa: E402
from trainer.checkpoint.hf import read_hf, write_hf  # noqa: E402
from trainer.models import build_model, materialize, model_config  # noqa: E402


def from_hf(hf_dir: Path, out: Path, model: str | None) -> None:
    cfg, weights = read_hf(hf_dir)
    if model is not None:
        named = model_config(model)
        check_model(named, cfg, f"{hf_dir}")
        cfg.name = named.name
    save_weights(cfg, weights, out)
    print(f"wrote {cfg.family} model {cfg.name} ({sum(w.numel() for w in weights.values()) / 1e6:.2f}M values) to {out}")


def to_hf(checkpoint: Path, out: Path, model: str | None) -> None:
    cfg = model_config(model) if model is not None else saved_config(checkpoint)
    if cfg is None:
        raise ConfigError(f"{checkpoint} has no {MODEL_CONFIG}; name the model with --model")
    net = build_model(cfg, device="meta")
    materialize(net, "cpu")
    load_weights(net, checkpoint)
    write_hf(cfg, net.state_dict(), out)
    print(f"wrote {cfg.family} model {cfg.name} to {out}")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("direction", choices=["from-hf", "to-hf"])
    parser.add_argument("source", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--model", help="a model config name (configs/model/NAME.yaml)")
    args = parser.parse_args(argv)
    try:
        (from_hf if args.direction == "from-hf" else to_hf)(args.source, args.out, args.model)
    except ConfigError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main(sys.argv[1:])
