"""Checkpoints with torch.distributed.checkpoint (DCP), loadable by any parallel layout.

The model and optimizer state are saved under the whole model's parameter names (a pipeline
stage keeps the names of the whole model), as DTensor shards that DCP reassembles for whatever
layout loads them. Only tensors are saved, so loading never unpickles an object from a file; DCP's
own metadata is read with an allow-list of its classes.

A checkpoint is written to `step_N.tmp/` and published as `step_N/` by a rename, once every
rank's files are on disk and a manifest of their sizes and CRC32s has been written. A directory
without the `.tmp` suffix is therefore complete, and the manifest tells a damaged one.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import time
import warnings
import zlib
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from trainer.config import ModelConfig
from trainer.errors import ConfigError

MANIFEST = "manifest.json"
MODEL_CONFIG = "model.yaml"
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


class CheckpointError(ConfigError):
    """A checkpoint that is missing, incomplete or damaged."""


# --- what is saved --------------------------------------------------------------------------


def _whole_name(key: str, at: int) -> str:
    """Drops the model part's index ("0.", "1.", ...) from a key of nn.ModuleList(parts)'s state:
    the `at`-th dotted component (0 for model keys, 1 for "state.0.layers...")."""
    parts = key.split(".")
    return ".".join(parts[:at] + parts[at + 1:])


class TrainState:
    """Views of the model parts' and optimizer's state under the whole model's names, sharing
    storage with the live tensors, so DCP saves from them and loads into them in place."""

    def __init__(self, parts: list[nn.Module], optimizer: torch.optim.Optimizer | None = None):
        self.model, self.optimizer = nn.ModuleList(parts), optimizer

    def model_state(self) -> tuple[dict, dict]:
        live = get_model_state_dict(self.model)
        return live, {_whole_name(k, 0): v for k, v in live.items()}

    def optimizer_state(self) -> tuple[dict, dict]:
        # Flattened: one key per (parameter, state) pair. The param groups' hyperparameters are
        # not saved: they come from the config, and the LR schedule from the step.
        live = get_optimizer_state_dict(self.model, self.optimizer, options=_FLAT)
        return live, {_whole_name(k, 1): v for k, v in live.items() if k.startswith("state.")}

    def for_save(self, step: int, data_position: int) -> dict:
        state = {"model": self.model_state()[1], "optimizer": self.optimizer_state()[1]}
        rank, world = _rank_world()
        state["trainer"] = {
            "step": torch.tensor(step),
            "data_position": torch.tensor(data_position),
            "world_size": torch.tensor(world),
        }
        state["rng"] = {f"rank{rank}": _rng_state()}
        return state

    def load(self, path: Path) -> tuple[int, int]:
        """Loads everything from checkpoint `path`; returns (step, data position)."""
        live_model, model = self.model_state()
        live_optim, optim = self.optimizer_state()
        trainer = {"step": torch.tensor(0), "data_position": torch.tensor(0), "world_size": torch.tensor(0)}
        reader = SafeReader(path)
        keys = reader.read_metadata().state_dict_metadata
        if not any(k.startswith("optimizer.") for k in keys):
            raise CheckpointError(f"checkpoint.resume={path} holds weights only (a seed or converted "
                                  f"checkpoint); start from it with checkpoint.initial={path}")
        _dcp_load({"model": model, "optimizer": optim, "trainer": trainer}, path)
        set_model_state_dict(self.model, live_model)
        set_optimizer_state_dict(self.model, self.optimizer, live_optim, options=_FLAT)
        rank, world = _rank_world()
        # Random state is per rank: it carries over only to the same number of ranks.
        if f"rng.rank{rank}" in keys and int(trainer["world_size"]) == world:
            rng = {f"rank{rank}": _rng_state()}
            _dcp_load({"rng": rng}, path)
            _set_rng_state(rng[f"rank{rank}"])
        return int(trainer["step"]), int(trainer["data_position"])

    def load_weights(self, path: Path) -> None:
        live, model = self.model_state()
        _dcp_load({"model": model}, path)
        set_model_state_dict(self.model, live)


def _rng_state() -> torch.Tensor:
    """This rank's CPU (and current CUDA device's) random state, as one byte tensor."""
    states = [torch.get_rng_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states.append(torch.cuda.get_rng_state())
    return torch.cat(states)


def _set_rng_state(state: torch.Tensor) -> None:
    cpu = torch.get_rng_state().numel()
    torch.set_rng_state(state[:cpu].clone())
    if state.numel() > cpu and torch.cuda.is_available():
        torch.cuda.set_rng_state(state[cpu:].clone())


# --- reading safely -------------------------------------------------------------------------


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's metadata and nothing else: its own classes, torch dtypes and sizes, paths."""

    OTHERS = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
              ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("collections", "OrderedDict")}

    def find_class(self, module: str, name: str):
        allowed = (module.startswith("torch.distributed.checkpoint.") or (module, name) in self.OTHERS
                   or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)))
        if not allowed:
            raise pickle.UnpicklingError(f"{module}.{name} does not belong in checkpoint metadata")
        return super().find_class(module, name)


class SafeReader(FileSystemReader):
    """DCP's file reader, with its metadata read through the allow-list above (DCP itself uses a
    plain pickle.load, which would run whatever a crafted file names)."""

    def read_metadata(self, *args, **kwargs):
        path = Path(self.path) / ".metadata"
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ValueError) as e:
            raise CheckpointError(f"{self.path} is not a readable checkpoint: {path.name}: {e}") from None
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


@contextmanager
def _quiet_single_process():
    """DCP warns on every call made without a process group, which is how one-process tools use it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled, )?unavailable or uninitialized")
        yield


def _dcp_load(state: dict, path: Path) -> None:
    try:
        with _quiet_single_process():
            dcp.load(state, storage_reader=SafeReader(path), no_dist=not dist.is_initialized())
    except CheckpointError:
        raise
    except Exception as e:  # DCP wraps each rank's failure; its message names the missing key or file
        first = str(e).strip().splitlines()
        raise CheckpointError(f"cannot load checkpoint {path}: {first[-1] if first else type(e).__name__}") from None


# --- publishing and verifying ---------------------------------------------------------------


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


def _gather(value, world: int) -> list:
    if world == 1:
        return [value]
    out = [None] * world
    dist.all_gather_object(out, value)
    return out


def publish(tmp: Path, final: Path, step: int, rank: int, world: int) -> None:
    """Collective: checksums the files of a finished save, writes the manifest, renames tmp to final."""
    sums = {k: v for part in _gather(_sums(tmp, rank, world), world) for k, v in part.items()}
    if rank == 0:
        with open(tmp / MANIFEST, "w") as f:
            json.dump({"step": step, "files": sums}, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        if final.exists():  # the same step saved again (a resumed run): the new one replaces it
            old = final.with_name(final.name + ".old")
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old)
        else:
            tmp.rename(final)
    if world > 1:
        dist.barrier()


def verify(path: Path, rank: int = 0, world: int = 1) -> str | None:
    """Collective: None if checkpoint `path` is complete and undamaged, else what is wrong."""
    problem = None
    manifest = path / MANIFEST
    if not path.is_dir():
        problem = "no such directory"
    elif not manifest.is_file():
        problem = f"no {MANIFEST}: an incomplete save, or not a checkpoint of this trainer"
    if problem is None:
        try:
            expected = json.loads(manifest.read_text())["files"]
        except (ValueError, KeyError) as e:
            problem = f"{MANIFEST} is unreadable ({e})"
    if problem is None:
        missing = sorted(set(expected) - {p.name for p in _files(path)})
        if missing:
            problem = f"missing {missing[0]}"
    if problem is None:
        names = sorted(expected)[rank::world]
        for name in names:
            size, crc = (path / name).stat().st_size, None
            if size != expected[name][0]:
                problem = f"{name} is {size} bytes, the manifest says {expected[name][0]}"
                break
            crc = _crc32(path / name)
            if crc != expected[name][1]:
                problem = f"{name} is damaged (CRC32 {crc:08x}, the manifest says {expected[name][1]:08x})"
                break
    found = [p for p in _gather(problem, world) if p]
    return found[0] if found else None


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


def find_resume(folder: Path, rank: int, world: int, log) -> Path | None:
    """Collective: the newest complete, undamaged checkpoint in `folder` (skipping damaged ones)."""
    for _, path in reversed(checkpoint_steps(folder)):
        problem = verify(path, rank, world)
        if problem is None:
            return path
        log(f"checkpoint: skipping {path}: {problem}")
    return None


# --- the saver ------------------------------------------------------------------------------


# --- starting and resuming -----------------------------------------------------------------


def restore(cfg, state: TrainState, folder: Path, model_cfg: ModelConfig, log) -> tuple[int, int]:
    """Collective: loads what checkpoint.* asks for (`cfg`: a CheckpointConfig); returns the step
    and data position to go on from, (0, 0) for a fresh start."""
    rank, world = _rank_world()
    path = None
    if cfg.resume not in ("auto", "none"):
        path = Path(cfg.resume)
        problem = verify(path, rank, world)
        if problem is not None:
            raise CheckpointError(f"checkpoint.resume={cfg.resume} cannot be loaded: {problem}")
    elif cfg.resume == "auto" and cfg.enabled:
        path = find_resume(folder, rank, world, log)
    if path is not None:
        _check_model(model_cfg, _saved_config(path), f"checkpoint.resume={path}")
        started = time.perf_counter()
        step, position = state.load(path)
        log(f"checkpoint: resumed from {path} at step {step} (loaded in {time.perf_counter() - started:.2f}s)")
        return step, position
    if cfg.initial:
        load_weights(list(state.model), cfg.initial, key="checkpoint.initial")
        log(f"checkpoint: initial weights from {cfg.initial}")
    return 0, 0


def load_weights(model: nn.Module | list[nn.Module], path: str | Path, key: str = "path") -> None:
    """Loads weights into `model` (a plain model, or a parallelized model's parts) from a
    checkpoint of ours (any layout, weights or full training state) or a Hugging Face directory."""
    from trainer.hf import is_hf_dir, read_hf
    from trainer.models import copy_full_weights

    parts = list(model) if isinstance(model, (list, tuple)) else [model]
    path = Path(path)
    if is_hf_dir(path):
        saved, weights = read_hf(path)
        _check_model(parts[0].config, saved, f"{key}={path}")
        for part in parts:
            copy_full_weights(part, weights)
        return
    problem = verify(path, *_rank_world())
    if problem is not None:
        raise CheckpointError(f"{key}={path} is neither a Hugging Face directory nor a usable checkpoint: {problem}")
    _check_model(parts[0].config, _saved_config(path), f"{key}={path}")
    TrainState(parts).load_weights(path)


def save_weights(cfg: ModelConfig, weights: dict[str, torch.Tensor], out: Path) -> None:
    """Writes full weights as a weights-only checkpoint (a seed or converted one), from one process."""
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"{out} exists and is not empty; choose a new directory")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    OmegaConf.save(OmegaConf.structured(cfg), tmp / MODEL_CONFIG)
    with _quiet_single_process():
        dcp.save({"model": weights}, checkpoint_id=tmp, no_dist=True)
    if out.exists():
        out.rmdir()
    publish(tmp, out, 0, 0, 1)


def _saved_config(path: Path) -> ModelConfig | None:
    from trainer.models import model_config

    file = path / MODEL_CONFIG
    return model_config(OmegaConf.load(file)) if file.is_file() else None


_SAME = ("family", "dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_dim", "norm_eps", "rope_theta",
         "n_experts", "top_k", "tie_embeddings")


def _check_model(ours: ModelConfig, saved: ModelConfig | None, what: str) -> None:
    """A checkpoint loads only into the same architecture; the first difference is the error."""
    if saved is None:
        return
    for name in _SAME:
        a, b = getattr(saved, name), getattr(ours, name)
        if a != b and not (isinstance(a, float) and abs(a - b) <= 1e-9 * abs(b)):
            raise CheckpointError(f"{what} holds a model with model.{name}={a}, but this model has model.{name}={b}")


def _rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


class StopSignal:
    """SIGTERM or SIGUSR1 (what Slurm sends before a time limit or a preemption, and what torchrun
    forwards) becomes a request to stop after the current step; the loop saves and exits cleanly."""

    def __init__(self):
        self.received: int | None = None
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.received = signum


class Checkpointer:
    """Saves every `interval` steps and at the last into `folder` (synchronously, or overlapped
    with training), publishes each save once all ranks are done, keeps the newest `keep_last`,
    and saves at once when any rank is asked to stop."""

    def __init__(self, folder: Path, interval: int, keep_last: int, async_save: bool, model_config: dict,
                 device: torch.device):
        self.folder, self.interval, self.keep_last, self.async_save = folder, interval, keep_last, async_save
        self.model_config, self.device = model_config, device
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        # Async saves run their collectives on a group of their own, apart from training's.
        self.group = dist.new_group(backend="gloo") if async_save else None
        self.pending: tuple[int, Future] | None = None
        self.started = self.blocked = 0.0  # when the last save began; how long it held up training
        self.stop = StopSignal()
        if self.rank == 0:
            for stale in folder.glob("step_*.tmp"):  # a save that never finished
                shutil.rmtree(stale, ignore_errors=True)
            folder.mkdir(parents=True, exist_ok=True)

    def after_step(self, step: int, last_step: int, state_fn) -> bool:
        """Collective, after each optimizer step: publishes a finished async save, saves when due
        (or when any rank was signalled) with state_fn()'s state; returns whether to stop."""
        flags = torch.tensor([self.stop.received is not None, self.busy()], dtype=torch.int32, device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        stop, busy = flags.tolist()
        if self.pending is not None and not busy:
            self.wait()
        if stop or step == last_step or step % self.interval == 0:
            self.save(step, state_fn(), wait=bool(stop) or step == last_step)
        if stop and self.rank == 0:
            print(f"checkpoint: stopped at step {step} on a signal; resume with checkpoint.resume=auto", flush=True)
        return bool(stop)

    def _paths(self, step: int) -> tuple[Path, Path]:
        final = self.folder / f"step_{step}"
        return final.with_name(final.name + ".tmp"), final

    def save(self, step: int, state: dict, wait: bool = False) -> None:
        self.wait()
        self.started = time.perf_counter()
        tmp, final = self._paths(step)
        if self.rank == 0:
            tmp.mkdir(parents=True, exist_ok=True)
            OmegaConf.save(OmegaConf.create(self.model_config), tmp / MODEL_CONFIG)
        dist.barrier()
        if self.async_save and not wait:
            # Copies the state to host memory, then writes it while training goes on; done once
            # this rank's files (and, on rank 0, the metadata) are written.
            self.pending = (step, dcp.async_save(state, checkpoint_id=tmp, process_group=self.group))
            self.blocked = time.perf_counter() - self.started
        else:
            dcp.save(state, checkpoint_id=tmp)
            self.blocked = None
            self._publish(step)

    def busy(self) -> bool:
        """Whether this rank's part of a pending save is still being written."""
        return self.pending is not None and not self.pending[1].done()

    def wait(self) -> None:
        """Collective: waits for a pending save and publishes it."""
        if self.pending is not None:
            step, future = self.pending
            future.result()
            self.pending = None
            self._publish(step)

    def _publish(self, step: int) -> None:
        tmp, final = self._paths(step)
        publish(tmp, final, step, self.rank, self.world)
        if self.rank == 0:
            took = time.perf_counter() - self.started
            blocked = f"training held up {self.blocked:.2f}s" if self.blocked is not None else "synchronous"
            print(f"checkpoint: saved step {step} to {final} in {took:.2f}s ({blocked})", flush=True)
            if self.keep_last > 0:
                for _, old in checkpoint_steps(self.folder)[: -self.keep_last]:
                    shutil.rmtree(old, ignore_errors=True)

    def close(self) -> None:
        self.wait()
        if self.group is not None:
            dist.destroy_process_group(self.group)
