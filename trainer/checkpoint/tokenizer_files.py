"""The tokenizer beside the weights. A checkpoint folder keeps the tokenizer files its run trained
with (data.tokenizer's: tokenizer.json and, where they exist, tokenizer_config.json and
special_tokens_map.json), so that a Hugging Face export can carry them, with the special ids that
transformers' `generate` needs in config.json and generation_config.json.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from trainer.data.tokenizer import build_tokenizer, is_bytes

TOKENIZER = "tokenizer.json"
BESIDE = ("tokenizer_config.json", "special_tokens_map.json")


def tokenizer_files(spec: str) -> dict[str, Path]:
    """The files of tokenizer `spec` (data.tokenizer: a tokenizer.json, or a folder holding one) by
    the name they are kept under; none for the byte tokenizer."""
    if is_bytes(spec):
        return {}
    path = Path(spec)
    folder, main = (path, path / TOKENIZER) if path.is_dir() else (path.parent, path)
    return {TOKENIZER: main} | {name: folder / name for name in BESIDE if (folder / name).is_file()}


def copy_tokenizer(spec: str, folder: Path) -> None:
    """Copies tokenizer `spec`'s files into `folder` (a checkpoint being written)."""
    for name, source in tokenizer_files(spec).items():
        shutil.copyfile(source, folder / name)


def held_tokenizer(folder: Path) -> str | None:
    """The tokenizer a checkpoint or Hugging Face folder holds (its path, as data.tokenizer takes
    it)."""
    return str(folder) if (folder / TOKENIZER).is_file() else None


def resolve_tokenizer(spec: str, source: str, initial: str | None) -> str:
    """data.tokenizer with `auto` resolved: the tokenizer held beside checkpoint.initial's weights
    (a Hugging Face folder's, or the one a checkpoint of ours kept), else bytes; the embedded text
    is always bytes."""
    if spec != "auto":
        return spec
    held = held_tokenizer(Path(initial)) if initial is not None and source != "embedded" else None
    return held or "bytes"


def special_ids(spec: str) -> dict[str, int | None]:
    """bos/eos/pad token ids as transformers' configs name them: the ones training used (pad: the
    tokenizer's own, else end-of-sequence, as generate pads)."""
    tokenizer = build_tokenizer(spec)
    pad = tokenizer.pad_id
    return {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id,
            "pad_token_id": tokenizer.eos_id if pad is None else pad}


def export_tokenizer(spec: str, out: Path) -> list[str]:
    """Writes tokenizer `spec` into Hugging Face folder `out` for AutoTokenizer: its files, with a
    tokenizer_config.json naming the special tokens training used. The names of the files
    written."""
    files = tokenizer_files(spec)
    for name, source in files.items():
        shutil.copyfile(source, out / name)
    tokenizer, ids = build_tokenizer(spec), special_ids(spec)
    config_file = out / BESIDE[0]
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    for key in ("bos", "eos", "pad"):
        if ids[f"{key}_token_id"] is not None:
            config[f"{key}_token"] = tokenizer.tokenizer.id_to_token(ids[f"{key}_token_id"])
    config_file.write_text(json.dumps(config, indent=2) + "\n")
    return sorted({*files, BESIDE[0]})


def write_special_ids(out: Path, ids: dict[str, int | None]) -> None:
    """The special ids into `out`'s config.json, and generation_config.json (which generate
    reads)."""
    path = out / "config.json"
    config = json.loads(path.read_text()) | ids
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    generation = {k: v for k, v in ids.items() if v is not None}
    if generation:
        (out / "generation_config.json").write_text(json.dumps(generation, indent=2, sort_keys=True)
                                                    + "\n")
