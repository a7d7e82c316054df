"""Converts between Hugging Face directories and this trainer's checkpoints.

    # OUT: a checkpoint.initial
    python scripts/convert_hf.py from-hf HF_DIR OUT [--model NAME] [--write-config NAME]
    python scripts/convert_hf.py to-hf CKPT OUT [--model NAME] [--tokenizer PATH] \
        [--dtype bfloat16] [--max-shard-size 5GB] [--merge] [--base PATH [--force]]

--write-config NAME also writes configs/model/NAME.yaml, the model HF_DIR holds, for `model=NAME`.
CKPT is any checkpoint of ours (a training checkpoint in any layout, a seed or a converted one).
--model names one of configs/model/ to check the weights against (from-hf) or to use when CKPT
holds no model.yaml (to-hf). to-hf streams one tensor at a time into safetensors shards of at most
--max-shard-size, in --dtype (bfloat16, as released checkpoints are), with transformers' index file
when there are several; OUT loads with AutoModelForCausalLM. The tokenizer goes along both ways:
from-hf keeps HF_DIR's tokenizer files with the weights, and to-hf writes the one CKPT was trained
with (kept in the checkpoint, else the run's data.tokenizer, else --tokenizer) for AutoTokenizer,
with its bos/eos/pad ids in config.json and generation_config.json. Local directories only;
nothing is downloaded.

to-hf of a LoRA checkpoint (peft.method=lora: its adapters alone) writes peft's adapter directory
(adapter_config.json, adapter_model.safetensors), which PeftModel.from_pretrained loads on the base
model; --merge writes the base (--base, default the checkpoint.initial it trained from) with the
adapters folded in, a whole model. from-hf of peft's adapter directory writes a LoRA checkpoint of
ours on its base (--base, default its base_model_name_or_path): train on from it with
checkpoint.initial=OUT and the same peft keys. Adapters that do not fit the base's layers are
refused, and so is a --base other than the one the adapters record (when that one is here), unless
--force.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from trainer.checkpoint.folders import (  # noqa: E402
    ADAPTER_CONFIG,
    MANIFEST,
    MODEL_CONFIG,
    newest_step,
)
from trainer.checkpoint.hf import read_hf  # noqa: E402
from trainer.checkpoint.hf_export import export_hf  # noqa: E402
from trainer.checkpoint.peft_io import (  # noqa: E402
    PEFT_CONFIG,
    export_merged,
    export_peft,
    import_peft,
)
from trainer.checkpoint.rerun import trained_with  # noqa: E402
from trainer.checkpoint.state import check_same_shape, save_weights, saved_config  # noqa: E402
from trainer.checkpoint.tokenizer_files import (  # noqa: E402
    export_tokenizer,
    held_tokenizer,
    resolve_tokenizer,
    special_ids,
    write_special_ids,
)
from trainer.errors import ConfigError  # noqa: E402
from trainer.models import model_config  # noqa: E402

UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "B": 1}


def from_hf(hf_dir: Path, out: Path, model: str | None, write_config: str | None = None) -> None:
    cfg, weights = read_hf(hf_dir)
    if model is not None:
        named = model_config(model)
        check_same_shape(named, cfg, f"{hf_dir}")
        cfg.name = named.name
    cfg.name = write_config or cfg.name
    if write_config is not None:
        model_config_path(write_config)  # (refused before any weight is written)
    tokenizer = held_tokenizer(hf_dir)
    save_weights(cfg, weights, out, tokenizer)
    print(f"wrote {cfg.family} model {cfg.name} "
          f"({sum(w.numel() for w in weights.values()) / 1e6:.2f}M values) to {out}"
          + (" with its tokenizer" if tokenizer else "; no tokenizer.json beside the weights"))
    if write_config is not None:
        print(f"wrote {write_model_config(cfg, hf_dir)}: train it with model={write_config}")


def to_hf(checkpoint: Path, out: Path, model: str | None, dtype: str, max_shard_size: str,
          tokenizer: str | None = None, merge: bool = False, base: str | None = None,
          force: bool = False) -> None:
    checkpoint = newest_step(checkpoint, "to-hf", print)
    if not checkpoint.is_dir():
        raise ConfigError(f"{checkpoint} is not a folder")
    if not (checkpoint / MANIFEST).is_file():
        raise ConfigError(f"{checkpoint} is not a checkpoint of this trainer: a checkpoint is a "
                          f"folder holding {MANIFEST} (a run's checkpoints/step_N, a seed, a "
                          "from-hf output); give one, or a run's output_dir for its newest")
    cfg = model_config(model) if model is not None else saved_config(checkpoint)
    if cfg is None:
        raise ConfigError(f"{checkpoint} has no {MODEL_CONFIG}; name the model with --model")
    tokenizer = tokenizer or held_tokenizer(checkpoint) or run_tokenizer(checkpoint)
    if tokenizer is not None and tokenizer != "bytes":
        check_vocabulary(tokenizer, cfg.vocab_size)
    if (checkpoint / ADAPTER_CONFIG).is_file() and not merge:
        layers = export_peft(checkpoint, cfg, out, base=base)
        print(f"wrote the LoRA adapters of {layers} layers to {out} (peft's adapter directory: "
              "PeftModel.from_pretrained(model, OUT)); --merge writes them folded into the base")
        return
    if (checkpoint / ADAPTER_CONFIG).is_file():
        shards = export_merged(checkpoint, cfg, out, base, getattr(torch, dtype),
                               shard_bytes(max_shard_size), force)
    elif merge:
        raise ConfigError(f"--merge: {checkpoint} holds no LoRA adapters (a full model's "
                          "checkpoint converts without --merge)")
    else:
        shards = export_hf(checkpoint, cfg, out, getattr(torch, dtype),
                           shard_bytes(max_shard_size))
    print(f"wrote {cfg.family} model {cfg.name} to {out} in {dtype}, {shards} "
          f"shard{'s' if shards > 1 else ''}" + (", the adapters merged" if merge else ""))
    if tokenizer is None:
        write_special_ids(out, {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None})
        print(f"no tokenizer: {checkpoint} holds none and names no run's data.tokenizer; "
              "config.json has no bos/eos ids. Pass --tokenizer PATH (the run's data.tokenizer) to "
              "write both")
        return
    ids = special_ids(tokenizer)
    write_special_ids(out, ids)
    said = ", ".join(f"{k.removesuffix('_token_id')} {v}" for k, v in ids.items() if v is not None)
    if tokenizer == "bytes":
        print("no tokenizer files: the run trained on UTF-8 bytes, which transformers has no "
              f"tokenizer for; config.json and generation_config.json say {said}")
    else:
        written = export_tokenizer(tokenizer, out)
        print(f"wrote the tokenizer from {tokenizer} ({', '.join(written)}); config.json and "
              f"generation_config.json say {said}")


def model_config_path(name: str) -> Path:
    """configs/model/NAME.yaml, which must not exist yet."""
    from trainer.config import files as config_files

    path = config_files.CONFIG_DIR / "model" / f"{name}.yaml"
    if path.exists():
        raise ConfigError(f"--write-config={name}: {path} exists; choose another name")
    return path


def write_model_config(cfg, hf_dir: Path) -> Path:
    """configs/model/NAME.yaml (NAME: cfg.name) holding `cfg`."""
    from omegaconf import OmegaConf

    path = model_config_path(cfg.name)
    path.write_text(f"# The model of {hf_dir.resolve()} (scripts/convert_hf.py from-hf "
                    "--write-config).\n"
                    + OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    return path


def run_tokenizer(checkpoint: Path) -> str | None:
    """data.tokenizer of the run that saved a training checkpoint, where the config it records (or,
    saved by an earlier version, its run's config.yaml) says it and it is still there."""
    saved = trained_with(checkpoint.resolve())
    if saved is None:
        return None
    spec = resolve_tokenizer(saved.get("data", {}).get("tokenizer", "bytes"),
                             saved.get("data", {}).get("source", ""),
                             saved.get("checkpoint", {}).get("initial"))
    return spec if spec == "bytes" or Path(spec).exists() else None


def check_vocabulary(tokenizer: str, vocab_size: int) -> None:
    from trainer.data.tokenizer import build_tokenizer

    needed = build_tokenizer(tokenizer).vocab_size
    if needed > vocab_size:
        raise ConfigError(f"the tokenizer {tokenizer} has ids up to {needed - 1}, beyond the "
                          f"model's vocabulary of {vocab_size}: not the tokenizer this model was "
                          "trained with")


def shard_bytes(size: str) -> int:
    """"5GB", "500MB", "1000000" -> bytes (decimal units, as transformers counts them)."""
    text = size.strip().upper()
    unit = next((u for u in UNITS if text.endswith(u)), "")
    try:
        value = float(text[:len(text) - len(unit)]) * UNITS.get(unit, 1)
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigError(f"--max-shard-size={size} is not a size; write e.g. 5GB, 500MB or a "
                          "number of bytes")
    return int(value)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("direction", choices=["from-hf", "to-hf"])
    parser.add_argument("source", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--model", help="a model config name (configs/model/NAME.yaml)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                        help="to-hf: the dtype written (default bfloat16)")
    parser.add_argument("--max-shard-size", default="5GB",
                        help="to-hf: the largest shard file (default 5GB)")
    parser.add_argument("--write-config", metavar="NAME",
                        help="from-hf: also write configs/model/NAME.yaml, the model the directory "
                             "holds")
    parser.add_argument("--merge", action="store_true",
                        help="to-hf of a LoRA checkpoint: the base with the adapters folded in "
                             "(default: peft's adapter directory)")
    parser.add_argument("--base",
                        help="to-hf of a LoRA checkpoint, from-hf of a peft adapter: its base "
                             "(default: the checkpoint.initial it trained from; the adapter's "
                             "base_model_name_or_path)")
    parser.add_argument("--force", action="store_true",
                        help="with --base: take a base other than the one the adapters were "
                             "trained on (with a warning)")
    parser.add_argument("--tokenizer",
                        help="to-hf: the tokenizer to write, when the checkpoint holds none "
                             "(a tokenizer.json, or a folder holding one)")
    args = parser.parse_args(argv)
    try:
        if args.direction == "from-hf" and (args.source / PEFT_CONFIG).is_file():
            layers = import_peft(args.source, args.out, args.base, args.force)
            print(f"wrote the LoRA adapters of {layers} layers to {args.out}: train on from them "
                  f"with checkpoint.initial={args.out} and the peft keys of its adapter.yaml")
        elif args.direction == "from-hf":
            from_hf(args.source, args.out, args.model, args.write_config)
        else:
            to_hf(args.source, args.out, args.model, args.dtype, args.max_shard_size,
                  args.tokenizer, args.merge, args.base, args.force)
    except ConfigError as e:
        sys.stderr.write(f"config error: {e}\n")
        sys.exit(2)


if __name__ == "__main__":
    main(sys.argv[1:])
