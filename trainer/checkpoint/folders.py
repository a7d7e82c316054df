"""A checkpoint on disk: atomic publishing, verification, and finding the newest.

A checkpoint is written to `step_N.tmp/` and published as `step_N/` by a rename, once every
rank's files are on disk and a manifest of their sizes and CRC32s has been written. A directory
without the `.tmp` suffix is therefore complete, and the manifest tells a damaged one.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

import torch.distributed as dist
from omegaconf import OmegaConf

from trainer.checkpoint.metadata import CheckpointError
from trainer.safe_write import move_aside

MANIFEST = "manifest.json"
MODEL_CONFIG = "model.yaml"
# In a LoRA run's checkpoint: the peft keys it trained with and its frozen base (`base`: the
# checkpoint.initial it started from; null: the base the seed drew).
ADAPTER_CONFIG = "adapter.yaml"


def adapter_base(initial: str | None) -> str | None:
    """The frozen base of a LoRA run started from `initial`: its weights, or the base they name
    when they are LoRA adapters themselves (a LoRA checkpoint or an imported peft adapter)."""
    file = Path(initial) / ADAPTER_CONFIG if initial else None
    if file is None or not file.is_file():
        return initial
    return OmegaConf.load(file).get("base")


def check_same_method(path: Path, adapted: bool) -> str | None:
    """A LoRA checkpoint resumes only as LoRA, a full one only as a full fine-tune; returns the
    frozen base a LoRA checkpoint names."""
    file = path / ADAPTER_CONFIG
    if file.is_file() and not adapted:
        raise CheckpointError(f"checkpoint.resume={path} holds LoRA adapters on a frozen base; "
                              "resume it with peft.method=lora, or train the whole model from "
                              "its merged weights (scripts/convert_hf.py --merge)")
    if adapted and not file.is_file():
        raise CheckpointError(f"checkpoint.resume={path} holds a full fine-tune; peft.method=lora "
                              f"starts adapters on its weights with checkpoint.initial={path} "
                              "and checkpoint.resume=none")
    return OmegaConf.load(file).get("base") if adapted else None


def adapter_layers(names) -> list[str]:
    """The layers that adapter names (layers.0.attention.wq.lora_A) belong to, sorted."""
    return sorted({name.rpartition(".")[0] for name in names})


class SaveFailed(Exception):
    """A rank could not write its part of a checkpoint (raised on every rank)."""


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and p.name != MANIFEST)


def _sums(folder: Path, rank: int, world: int) -> dict[str, list[int]]:
    """Size and CRC32 of this rank's share of the files (every world-th one)."""
    return {p.name: [p.stat().st_size, _crc32(p)] for p in _files(folder)[rank::world]}


def _gather(value, world: int, group=None) -> list:
    if world == 1:
        return [value]
    out = [None] * world
    dist.all_gather_object(out, value, group=group)
    return out


def publish(tmp: Path, final: Path, step: int, rank: int, world: int, group=None,
            run: str | None = None) -> None:
    """Collective (over `group`, default the world): checksums the files of a finished save, writes
    the manifest (with the `run` that saved it), renames tmp to final."""
    sums = {k: v for part in _gather(_sums(tmp, rank, world), world, group)
            for k, v in part.items()}

    def write_manifest() -> None:
        with open(tmp / MANIFEST, "w") as f:
            json.dump({"step": step, "run": run, "files": sums}, f, indent=1)
            f.flush()
            os.fsync(f.fileno())

    def rename() -> None:
        if final.exists():  # the same step saved again: the one there is kept, under another name
            aside = move_aside(final, "replaced")
            print(f"checkpoint: {final} existed (a checkpoint is never overwritten): moved it to "
                  f"{aside}", flush=True)
        tmp.rename(final)

    on_rank_0(write_manifest, tmp / MANIFEST, rank, world, group, then=rename)


def on_rank_0(work, where: Path, rank: int, world: int, group=None, then=None) -> None:
    """Collective, where a barrier would be: rank 0 does `work` (file work), then `then` if it
    succeeded; an OSError in `work` raises SaveFailed on every rank, naming `where`."""
    problem = None
    if rank == 0:
        try:
            work()
        except OSError as e:
            problem = f"{where}: {e}"
        else:
            if then is not None:
                then()
    found = [p for p in _gather(problem, world, group) if p]
    if found:
        raise SaveFailed(found[0])


def verify(path: Path, rank: int = 0, world: int = 1) -> str | None:
    """Collective: None if checkpoint `path` is complete and undamaged, else what is wrong."""
    found = [p for p in _gather(_problem(path, rank, world), world) if p]
    return found[0] if found else None


NO_FOLDER = "no such directory"
NO_MANIFEST = f"no {MANIFEST}: an incomplete save, or not a checkpoint of this trainer"


def is_not_a_checkpoint(problem: str) -> bool:
    """Whether verify()'s `problem` says the folder is no checkpoint at all (not a damaged one)."""
    return problem in (NO_FOLDER, NO_MANIFEST)


def read_manifest(path: Path) -> dict | str:
    """Checkpoint `path`'s manifest, or what is wrong with it."""
    if not path.is_dir():
        return NO_FOLDER
    if not (path / MANIFEST).is_file():
        return NO_MANIFEST
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = manifest["files"]
        if not (isinstance(files, dict) and all(
                isinstance(v, list) and len(v) == 2 and all(isinstance(n, int) for n in v)
                for v in files.values())):
            raise ValueError("its files are not a mapping of names to [size, CRC32]")
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{MANIFEST} is unreadable ({e})"
    return manifest


def all_damaged(damaged: list[tuple[Path, str]]) -> CheckpointError:
    """resume=auto's refusal when every checkpoint is damaged: not a fresh start over a run's lost
    progress."""
    listed = "; ".join(f"{p}: {why}" for p, why in damaged[:4])
    return CheckpointError(f"checkpoint.resume=auto: every checkpoint is damaged ({listed}"
                           f"{'; ...' if len(damaged) > 4 else ''}); nothing was resumed or "
                           "changed. To start afresh, add checkpoint.resume=none (they are then "
                           "set aside, kept); or resume one by name, checkpoint.resume=PATH")


def run_of(path: Path) -> str | None:
    """The run that saved checkpoint `path` (its manifest's `run`; None for none, or a checkpoint
    of a version of this trainer that did not record it)."""
    manifest = read_manifest(path)
    run = manifest.get("run") if isinstance(manifest, dict) else None
    return run if isinstance(run, str) else None


def _problem(path: Path, rank: int, world: int, crc: bool = True) -> str | None:
    """What is wrong with this rank's share of checkpoint `path`'s files, if anything (without
    `crc`: with any of its files' presence and sizes, read from the folder alone)."""
    manifest = read_manifest(path)
    if isinstance(manifest, str):
        return manifest
    expected = manifest["files"]
    missing = sorted(set(expected) - {p.name for p in _files(path)})
    if missing:
        return f"missing {missing[0]}"
    for name in sorted(expected)[rank::world] if crc else sorted(expected):
        size, sum_ = expected[name]
        if (path / name).stat().st_size != size:
            return f"{name} is {(path / name).stat().st_size} bytes, the manifest says {size}"
        if crc and (actual := _crc32(path / name)) != sum_:
            return f"{name} is damaged (CRC32 {actual:08x}, the manifest says {sum_:08x})"
    return None


def quick_problem(path: Path) -> str | None:
    """Before launch: what is wrong with checkpoint `path` that its manifest and its files' sizes
    tell (the ranks read every byte of their share again for the CRC32s)."""
    try:
        return _problem(path, 0, 1, crc=False)
    except OSError as e:
        return f"cannot be read: {e.strerror or e}"


def checkpoint_steps(folder: Path) -> list[tuple[int, Path]]:
    """The published checkpoints in `folder`, oldest first."""
    if not folder.is_dir():
        return []
    found = []
    for p in folder.iterdir():
        name, _, number = p.name.partition("_")
        if name == "step" and number.isdigit() and p.is_dir():
            found.append((int(number), p))
    return sorted(found)


def find_resume(folder: Path | list[Path], rank: int, world: int, log,
                skipped: list | None = None) -> Path | None:
    """Collective: the newest complete, undamaged checkpoint in `folder` (or in any of several:
    the replica groups' under fault tolerance), skipping damaged ones (each said, and added to
    `skipped` as (path, what is wrong)).

    Rank 0's listing of the folder decides: on a shared filesystem that caches attributes (NFS,
    Lustre) ranks restarted quickly can list different newest checkpoints, and would load different
    steps, or hang verifying different ones."""
    folders = folder if isinstance(folder, list) else [folder]
    found = sorted(found for f in folders for found in checkpoint_steps(f))
    candidates = [str(path) for _, path in reversed(found)] if rank == 0 else None
    if world > 1:
        shared = [candidates]
        dist.broadcast_object_list(shared, src=0)
        candidates = shared[0]
    for path in map(Path, candidates):
        problem = verify(path, rank, world)
        if problem is None:
            return path
        log(f"checkpoint: skipping {path}: {problem}")
        if skipped is not None:
            skipped.append((path, problem))
    return None



def newest_step(path: Path, key: str, log) -> Path:
    """Collective: `path` itself when it is a checkpoint; for a run's output folder (or its
    checkpoints/ folder) given instead, its newest complete step, said in one line."""
    folder = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    if (path / MANIFEST).is_file() or not checkpoint_steps(folder):
        return path
    found = find_resume(folder, *rank_world(), log)
    if found is None:
        raise CheckpointError(f"{key}={path} is a run's folder with no complete checkpoint in "
                              f"{folder}")
    log(f"checkpoint: {key}={path} is a run's folder: its newest complete step is {found}")
    return found


def rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
