"""Process-group set-up: torchrun's environment, or a world of one when run without it."""

from __future__ import annotations

import gc
import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from trainer.errors import ConfigError, TrainingStopped


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def resolve_device(setting: str) -> torch.device:
    """`auto`: the GPU of this local rank when one is visible, else the CPU (`setting` checked by
    ranges.py)."""
    if setting == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda but no GPU is visible; use device=cpu or device=auto")
    if setting == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# How long a collective may wait before it fails: the job's distributed.timeout_s, given to every
# group it makes (torch gives a new group its backend's default, not the world's).
_timeout = timedelta(seconds=1800)


def init_distributed(device: torch.device, timeout_s: float = 1800) -> None:
    """Joins the job's process group (NCCL on GPUs, gloo on CPU)."""
    global _timeout
    _timeout = timedelta(seconds=timeout_s)
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    try:
        store = _attempt_store()
        if store is None:
            dist.init_process_group(backend, timeout=_timeout)
        else:
            dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]),
                                    world_size=int(os.environ["WORLD_SIZE"]), timeout=_timeout)
    # a timeout, or a peer gone while joining (torch.distributed.DistError too)
    except RuntimeError as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TrainingStopped(f"rank {os.environ['RANK']} could not join the job's process group "
                              f"(restart {restart_count()}, distributed.timeout_s={timeout_s:g}): "
                              f"{reason}") from None


def restart_count() -> int:
    """torchrun's count of restarts after a failure (0: the first attempt; a node joining an elastic
    job restarts the ranks without counting)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def max_restarts() -> int:
    """How many restarts torchrun allows this job (--max-restarts; 0 without torchrun)."""
    return int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))


def _attempt_store() -> dist.Store | None:
    """The store of this attempt's process groups when torchrun shares its own with the ranks.

    torchrun's agent keeps its store across restarts (always with `--master_port`; with c10d unless
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), and torch names groups' keys the same in every attempt:
    a restarted rank would read the dead attempt's addresses and never connect. A prefix per attempt
    keeps them apart. A restart after a failure raises the count; a node joining restarts without
    raising it but always with a larger world, so the pair names each attempt once.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=_timeout)
    return dist.PrefixStore(f"trainer/restart_{restart_count()}/world_{world_size()}/", store)


def gloo_group() -> dist.ProcessGroup:
    """A new gloo group of every rank (host-side work beside the device's), with the job's
    timeout."""
    return dist.new_group(backend="gloo", timeout=_timeout)


def gather_floats(values: list[float], group) -> list[list[float]]:
    """Every rank's `values` on rank 0, in rank order; [] elsewhere (collective: a gather on
    `group`, a gloo group: host numbers, nothing waits for the device)."""
    mine = torch.tensor(values, dtype=torch.float64)
    gathered = ([torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
                if dist.get_rank() == 0 else None)
    dist.gather(mine, gathered, dst=0, group=group)
    return [g.tolist() for g in gathered] if gathered else []


def set_timeouts(meshes) -> None:
    """Gives every process group of these device meshes the job's timeout."""
    for mesh in meshes:
        for group in mesh.get_all_groups():
            if dist.get_backend(group) in ("gloo", "nccl"):  # not the memory plan's fake world
                group.set_timeout(_timeout)


def shutdown() -> None:
    # FSDP's state sits in reference cycles that hold gloo work objects; left to interpreter
    # teardown, freeing them can abort the process ("terminate called without an active exception").
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
