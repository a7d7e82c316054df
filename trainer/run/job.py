"""The training job on each rank: the config checked (before any rank works), the process group
joined, then trainer/run/setup.py builds the Trainer (trainer/run/loop.py), which runs the step
loop."""

from __future__ import annotations

import dataclasses
import math
import multiprocessing
import os
import sys

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from trainer.checkpoint.tokenizer_files import resolve_tokenizer
from trainer.checks.job import check_config
from trainer.checks.overrides import command_line, job_config
from trainer.config.schema import JobConfig
from trainer.data import build_dataset
from trainer.data.tokenizer import is_bytes
from trainer.distributed import init_distributed, resolve_device, shutdown, world_size
from trainer.errors import ConfigError, TrainingStopped
from trainer.faults.tolerance import check_lighthouse, group_output_dir, group_view
from trainer.faults.watchdog import Watchdog, enable_flight_recorder
from trainer.parallel.dims import ParallelDims
from trainer.plan import make_plan
from trainer.plan.auto import auto_device, calibration_note, choose_layout, pinned_keys
from trainer.plan.devices import local_device
from trainer.plan.search import apply_overrides, fitting_option
from trainer.run.allocator import reuse_freed_memory
from trainer.run.output import OutputLock
from trainer.run.prelaunch import check_output
from trainer.run.setup import build_trainer


def build_datasets(job: JobConfig):
    """The training windows and the validation ones: validation.path's files (all of them), else
    the training data's held-out split."""
    t = job.training
    if job.validation.path is None:
        return (build_dataset(job.data, t.seq_len, t.seed, split) for split in ("train", "val"))
    val_data = dataclasses.replace(job.data, path=job.validation.path)
    return (build_dataset(job.data, t.seq_len, t.seed, "all"),
            build_dataset(val_data, t.seq_len, t.seed, "all"))


def job_and_config(cfg: DictConfig) -> tuple[JobConfig, dict]:
    """The job `cfg` (a composed Hydra config) runs: its tokenizer resolved, its output_dir this
    replica group's; and the config as it runs (saved as config.yaml, compared by reruns), whose
    model section is the family's config whole, every key at its value, defaults included."""
    job = job_config(cfg)
    tokenizer = resolve_tokenizer(job.data.tokenizer, job.data.source, job.checkpoint.initial)
    job = dataclasses.replace(job, output_dir=group_output_dir(job),
                              data=dataclasses.replace(job.data, tokenizer=tokenizer))
    config = OmegaConf.to_container(cfg, resolve=True)
    config["data"]["tokenizer"] = tokenizer
    config["model"] = OmegaConf.to_container(OmegaConf.structured(job.model))
    return job, config


def run(cfg: DictConfig) -> None:
    """Runs the job `cfg` (the composed Hydra config) on this rank."""
    job, config = job_and_config(cfg)
    rank_0 = int(os.environ.get("RANK", "0")) == 0
    if job.data.tokenizer != cfg.data.tokenizer and not is_bytes(job.data.tokenizer) and rank_0:
        print("data: data.tokenizer=auto takes the tokenizer beside checkpoint.initial: "
              f"{job.data.tokenizer}", flush=True)
    device = resolve_device(job.device)
    if job.parallel.auto:
        job = choose_auto_layout(job, config, device)
    dims = check_config_launched(job)
    checkpoint = job.checkpoint
    check_lighthouse(job)
    schedule_change = check_output(job, config)
    if schedule_change and rank_0:
        print(schedule_change, flush=True)
    try:
        predicted = check_memory(job, dims, device) if job.plan.check else None
    except ConfigError as e:
        if job.device == "auto" and device.type == "cpu":  # a GPU recipe run where there is none
            plan = str(e).removeprefix("plan: ")
            raise ConfigError(f"no GPU is visible, so device=auto runs on the CPU, where {plan}; "
                              "for a CPU run add +smoke=cpu (or device=cpu with a small "
                              "model)") from None
        raise
    dataset, val_dataset = build_datasets(job)
    check_vocabulary(job, dataset)
    if device.type == "cpu" and job.training.cpu_reuse_memory:
        reuse_freed_memory()
    enable_flight_recorder(job.output_dir)
    lock = watchdog = None
    try:
        init_distributed(device, job.distributed.timeout_s)
        lock = OutputLock(job.output_dir, dist.get_rank())
        watchdog = Watchdog(job.distributed.step_timeout_s, job.distributed.timeout_s,
                            job.output_dir)
        build_trainer(job, config, dims, checkpoint, device, dataset, val_dataset,
                      predicted, watchdog).fit()
    except TrainingStopped as e:
        # Every rank reaches the same decision from the same all-reduced values; one line each.
        sys.stderr.write(f"training stopped: {e}\n")
        sys.stderr.flush()
        raise SystemExit(1) from None
    finally:
        if watchdog is not None:
            watchdog.shutdown()
        if lock is not None:
            lock.release()
        shutdown()


def check_vocabulary(job: JobConfig, dataset) -> None:
    if dataset.vocab_size > job.model.vocab_size:
        raise ConfigError(f"model.vocab_size={job.model.vocab_size} must be >= the tokenizer's "
                          f"{dataset.vocab_size} (data.tokenizer={job.data.tokenizer})")


# The sources whose reading before launch costs what the ranks' costs (local files, tokenized once
# into the cache the ranks then read; a token file's first ids); a stream or a chat set would be
# read twice.
CHECKED_FIRST = ("text", "json", "parquet", "binary")


def read_first(job: JobConfig) -> bool:
    """Whether check_data reads this job's data before launch (CHECKED_FIRST)."""
    data = job.data
    return not data.mix and data.format == "text" and data.source in CHECKED_FIRST


def check_data(job: JobConfig) -> None:
    """Before launch, in a process of its own: the data read as the ranks will read it (a file
    missing, a text field that holds no text, a token file of another vocabulary), the cache made
    for them. The process is no rank: what the data's reading says once a job (what it passed
    over) is left to rank 0."""
    if not read_first(job):
        return
    os.environ["RANK"] = "-1"
    dataset, _ = build_datasets(job)
    check_vocabulary(job, dataset)


def check_config_launched(job: JobConfig):
    """check_config on this launch's world; run without a launcher (`python train.py`, one process),
    a layout of several ranks is said as such, with the torchrun command that starts them."""
    try:
        return check_config(job, world_size())
    except ConfigError as e:
        p = job.parallel
        fixed = {k: getattr(p, k) for k in ("pp", "dp_replicate", "dp_shard", "cp", "tp")
                 if getattr(p, k) > 1}
        if "WORLD_SIZE" in os.environ or not fixed or "world size" not in str(e):
            raise
        ranks = math.prod(fixed.values())
        raise ConfigError(f"this layout ({' x '.join(f'{k}={v}' for k, v in fixed.items())}) needs "
                          f"{ranks} ranks at least and `python train.py` is one process: launch it "
                          f"with torchrun --nproc_per_node={ranks} train.py ... (or "
                          "trainer-run)") from None


def choose_auto_layout(job: JobConfig, config: dict, device: torch.device) -> JobConfig:
    """parallel=auto: the job in the layout the search chose (config, saved as config.yaml, records
    it)."""
    if job.fault_tolerance.enabled:
        raise ConfigError("parallel=auto cannot be combined with fault_tolerance.enabled=true: "
                          "each replica group would choose its own layout; give the degrees")
    target = auto_device(device, int(os.environ.get("LOCAL_WORLD_SIZE", "1")), job.plan.device)
    _, chosen, said = in_own_process(choose_layout, job, world_size(), target,
                                     pinned_keys(command_line()))
    note = calibration_note(job.plan.device, device.type)
    if int(os.environ.get("RANK", "0")) == 0:
        print(said if note is None else f"{note}\n{said}", flush=True)
    for key, value in chosen.items():
        section, name = key.split(".")
        config[section][name] = value
    return apply_overrides(job, chosen)


def check_memory(job: JobConfig, dims: ParallelDims, device: torch.device) -> float:
    """The plan's peak bytes on this rank's pipeline position; a `config error:` if it will not
    fit."""
    target = local_device(device, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    pp_rank = int(os.environ.get("RANK", "0")) // (dims.world_size // dims.pp)
    return in_own_process(_planned_peak, job, dims, target, pp_rank)


def _planned_peak(job: JobConfig, dims: ParallelDims, device, pp_rank: int) -> float:
    job = group_view(job)
    plan = make_plan(job, dims, device)
    if not plan.fits:
        plan.check_fits(fitting_option(job, dims, device))
    return plan.ranks[pp_rank].peak


def in_own_process(fn, *args):
    """fn(*args) in a forked process: the plan builds fake worlds of the job's size, and nothing
    torch keeps about them (a mesh's coordinates, measured: checkpoints then saved every rank's
    shards as rank 0's) may reach the real one. Its config error is raised here."""
    with multiprocessing.get_context("fork").Pool(1) as pool:
        result, error = pool.apply(_reporting, (fn, *args))
    if error is not None:
        raise ConfigError(error)
    return result


def _reporting(fn, *args):
    try:
        return fn(*args), None
    except ConfigError as e:
        return None, str(e)

