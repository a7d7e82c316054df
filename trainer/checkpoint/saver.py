"""Saving during training (every `interval` steps, on a stop signal, at the end) and restoring
at start-up (resume, or initial weights)."""

from __future__ import annotations

import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from trainer.checkpoint.folders import (
    ADAPTER_CONFIG,
    MODEL_CONFIG,
    CheckpointError,
    SaveFailed,
    all_damaged,
    check_same_method,
    checkpoint_steps,
    find_resume,
    is_not_a_checkpoint,
    newest_step,
    on_rank_0,
    publish,
    rank_world,
    verify,
)
from trainer.checkpoint.ownership import (
    clean_unfinished,
    continued_run,
    is_own_save,
    rotate,
    set_aside_others,
    start_save,
)
from trainer.checkpoint.rerun import TRAINED_CONFIG, check_settings
from trainer.checkpoint.state import TrainState, check_same_shape, load_weights, saved_config
from trainer.checkpoint.tokenizer_files import copy_tokenizer
from trainer.config.schema import ModelConfig
from trainer.distributed import gloo_group, max_restarts, restart_count
from trainer.errors import TrainingStopped


def restore(cfg, state: TrainState, folder: Path | list[Path], model_cfg: ModelConfig, log,
            config: dict | None = None) -> tuple[int, int, int | None, Path | None]:
    """Collective: loads what checkpoint.* asks for (`cfg`: a CheckpointConfig; `resume=auto` looks
    in `folder`, or folders, for a checkpoint trained with `config`'s settings); returns the step
    and data position to go on from, the world size that saved them and the checkpoint resumed:
    (0, 0, None, None) for a fresh start."""
    rank, world = rank_world()
    path = None
    if cfg.resume not in ("auto", "none"):
        path = newest_step(Path(cfg.resume), "checkpoint.resume", log)
        problem = verify(path, rank, world)
        if problem is not None:
            raise CheckpointError(f"checkpoint.resume={cfg.resume} cannot be loaded: {problem}")
    elif cfg.resume == "auto" and cfg.enabled:
        path = newest_undamaged(folder, rank, world, log)
        if path is not None and config is not None:
            check_settings(config, cfg, path)
    if path is not None:
        check_same_shape(model_cfg, saved_config(path), f"checkpoint.resume={path}")
        base = check_same_method(path, state.adapted)
        if state.adapted and (cfg.initial or base):  # the adapters' frozen base, then the state
            load_weights(list(state.model), newest_step(Path(cfg.initial or base),
                                                        "checkpoint.initial", log),
                         key="checkpoint.initial")
        started = time.perf_counter()
        step, position, saved_world = state.load(path)
        restarts = restart_count()
        restarted = f"restart {restarts} of at most {max_restarts()}: " if restarts else ""
        log(f"checkpoint: {restarted}resumed from {path} at step {step} "
            f"(loaded in {time.perf_counter() - started:.2f}s)")
        return step, position, saved_world, path
    if cfg.initial:
        load_weights(list(state.model), newest_step(Path(cfg.initial), "checkpoint.initial", log),
                     key="checkpoint.initial")
        log(f"checkpoint: initial weights from {cfg.initial}")
    return 0, 0, None, None


def newest_undamaged(folder: Path | list[Path], rank: int, world: int, log) -> Path | None:
    """Collective: resume=auto's checkpoint (find_resume's); when every checkpoint there is damaged,
    a refusal naming them, not a fresh start over a run's lost progress."""
    skipped: list[tuple[Path, str]] = []
    path = find_resume(folder, rank, world, log, skipped)
    damaged = [(p, why) for p, why in skipped if not is_not_a_checkpoint(why)]
    if path is None and damaged:
        raise all_damaged(damaged)
    return path


def roll_back(state: TrainState, folder: Path, checkpointer: Checkpointer, log) -> int | None:
    """Collective: reloads the newest complete checkpoint in `folder` (once a pending save is
    published) and returns its step; None when there is none yet."""
    checkpointer.wait()
    rank, world = rank_world()
    path = find_resume(folder, rank, world, log)
    if path is None:
        log("spike: no checkpoint to roll back to yet; the step was skipped")
        return None
    step, _, _ = state.load(path)
    return step


class Checkpointer:
    """Saves every `interval` steps and at the last into `folder` (synchronously, or overlapped
    with training), publishes each save once all ranks are done, keeps the newest `keep_last`,
    and saves at once when any rank is asked to stop.

    An async save holds training only while the state is copied to host buffers, allocated at the
    first save and reused (pinned on CUDA); the write, the CRC32 pass and the manifest, and the
    removal of old checkpoints happen on a background thread, over a gloo group of their own."""

    def __init__(self, folder: Path, interval: int, keep_last: int, async_save: bool,
                 config: dict, device: torch.device, tokenizer: str = "bytes",
                 adapter: dict | None = None):
        self.folder, self.interval = folder, interval
        self.adapter = adapter  # a LoRA run's peft keys and base (ADAPTER_CONFIG)
        self.keep_last, self.async_save = keep_last, async_save
        # the config the run trains with, in each save (what a rerun is held to); data.tokenizer's
        # files go in each save too
        self.config, self.tokenizer = config, tokenizer
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.log = partial(print, flush=True) if self.rank == 0 else lambda *_: None
        self.run = continued_run("none", None)  # until continue_run() says which run this is
        self.group = self.stager = self.background = None
        if async_save:
            # Async saves run their collectives on a group of their own, apart from training's.
            self.group = gloo_group()
            cuda = device.type == "cuda"
            self.stager = DefaultStager(StagingOptions(use_pinned_memory=cuda,
                                                       use_shared_memory=False,
                                                       use_async_staging=False,
                                                       use_non_blocking_copy=cuda))
            self.background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
        self.pending: tuple[int, Future] | None = None
        # told when this rank's shards of `step` are written
        self.before_publish = lambda step: None
        self.started = self.blocked = 0.0  # when the last save began; how long it held up training
        if self.rank == 0:
            clean_unfinished(folder, self.log)
            folder.mkdir(parents=True, exist_ok=True)

    def continue_run(self, resume: str, resumed: Path | None) -> None:
        """Which run this job is, once its checkpoint is resumed (`resumed`; None: a fresh start):
        the checkpoints of its folder it does not continue are set aside before it saves any."""
        self.run = continued_run(resume, resumed)
        if self.rank == 0:
            set_aside_others(self.folder, self.run, resumed, self.log)

    def after_step(self, step: int, last_step: int, state_fn, stop: bool = False) -> None:
        """Collective, after each optimizer step: saves when due, or at once when the job stops
        (`stop`), with state_fn()'s state."""
        if self.pending is not None and self.pending[1].done():
            self.wait()  # raises here what failed in the background
        if stop or step == last_step or step % self.interval == 0:
            self.save(step, state_fn(), wait=stop or step == last_step)

    def _paths(self, step: int) -> tuple[Path, Path]:
        final = self.folder / f"step_{step}"
        return final.with_name(final.name + ".tmp"), final

    def save(self, step: int, state: dict, wait: bool = False) -> None:
        """Collective. A save that fails on any rank (a full disk, a write error) stops training on
        every rank, its unfinished folder removed: the newest complete checkpoint stays the
        newest."""
        self.wait()
        try:
            self._save(step, state, wait)
        except (OSError, SaveFailed, CheckpointException) as e:
            raise self._failed(step, e) from None

    def _save(self, step: int, state: dict, wait: bool) -> None:
        self.started = time.perf_counter()
        tmp, final = self._paths(step)

        def start_folder() -> None:
            start_save(tmp, self.run, self.log)
            OmegaConf.save(OmegaConf.create(self.config["model"]), tmp / MODEL_CONFIG)
            OmegaConf.save(OmegaConf.create(self.config), tmp / TRAINED_CONFIG)
            copy_tokenizer(self.tokenizer, tmp)
            if self.adapter is not None:
                OmegaConf.save(OmegaConf.create(self.adapter), tmp / ADAPTER_CONFIG)

        on_rank_0(start_folder, tmp, self.rank, self.world)
        if self.async_save and not wait:
            # Copies the state to the host buffers; the rest goes on in the background.
            written = dcp.async_save(state, checkpoint_id=tmp, process_group=self.group,
                                     async_stager=self.stager)
            self.blocked = time.perf_counter() - self.started
            self.pending = (step, self.background.submit(self._publish_when_written, step, written))
        else:
            dcp.save(state, checkpoint_id=tmp)
            self.blocked = None
            self.before_publish(step)
            self._publish(step)

    def _publish_when_written(self, step: int, written: Future) -> None:
        written.result()
        self.before_publish(step)
        self._publish(step, self.group)

    def wait(self) -> None:
        """Waits for a pending save to be written and published."""
        if self.pending is not None:
            step, future = self.pending
            self.pending = None
            try:
                future.result()
            except (OSError, SaveFailed, CheckpointException) as e:
                raise self._failed(step, e) from None

    def _failed(self, step: int, error: BaseException) -> TrainingStopped:
        """Removes the save of `step` that failed with `error`; returns the error to stop with."""
        if isinstance(error, CheckpointException):  # DCP's, holding each failed rank's exception
            error = next(iter(error.failures.values()))[0]
        # A full disk shows as ENOSPC, or as a short write deep in torch.save: say how full it is.
        free = shutil.disk_usage(self.folder).free / 2**20
        if self.rank == 0 and is_own_save(self._paths(step)[0]):
            shutil.rmtree(self._paths(step)[0], ignore_errors=True)
        saved = checkpoint_steps(self.folder)
        kept = (f"the newest checkpoint is still {saved[-1][1]}" if saved
                else "no checkpoint was saved before it")
        cause = str(error).splitlines()[0] if str(error) else type(error).__name__
        return TrainingStopped(f"step {step}: checkpoint not saved ({cause}; {free:.1f} MiB free "
                               f"on its disk); {kept}")

    def _publish(self, step: int, group=None) -> None:
        tmp, final = self._paths(step)
        publish(tmp, final, step, self.rank, self.world, group, self.run)
        if self.rank == 0:
            took = time.perf_counter() - self.started
            blocked = (f"training held up {self.blocked:.2f}s" if self.blocked is not None
                       else "synchronous")
            self.log(f"checkpoint: saved step {step} to {final} in {took:.2f}s ({blocked})")
            rotate(self.folder, self.run, self.keep_last, final)

    def close(self) -> None:
        self.wait()
        if self.async_save:
            self.background.shutdown()
            self.stager.close()
            dist.destroy_process_group(self.group)
