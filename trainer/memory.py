"""Measured memory: the peak bytes of live tensors on this rank, and the process's peak.

On CUDA the caching allocator counts tensor bytes itself. On the CPU nothing does, so
`TensorMemory` watches every operator's outputs (a dispatch mode on the training thread) and
counts each new storage's bytes until the storage is freed: what the plan's prediction is held
against. Storages are counted once however many views share them; a DTensor counts its local shard.
"""

from __future__ import annotations

import resource
import weakref

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

GIB = 2**30


class TensorMemory(TorchDispatchMode):
    """Live and peak bytes of the tensors created while active (plus those passed to `add`)."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._storages: dict[int, weakref.ref] = {}

    def add(self, tensors) -> None:
        """Counts tensors made before tracking began (the model's parameters)."""
        for t in tensors:
            self._count(t)

    def reset_peak(self) -> None:
        self.peak = self.live

    def _count(self, t: torch.Tensor) -> None:
        if isinstance(t, DTensor):
            t = t.to_local()
        if t.device.type == "meta":
            return
        storage = t.untyped_storage()
        key = id(storage)
        if key in self._storages:
            return
        nbytes = storage.nbytes()
        # torch keeps one Python object per live storage, so its weak reference dies with the storage.
        self._storages[key] = weakref.ref(storage, lambda _, key=key, nbytes=nbytes: self._free(key, nbytes))
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def _free(self, key: int, nbytes: int) -> None:
        if self._storages.pop(key, None) is not None:
            self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._count(t)
        return out


def peak_memory_gib(device: torch.device) -> float:
    """The process's peak: CUDA's reserved bytes (what the allocator held), or the CPU's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_reserved(device) / GIB
    # Peak resident set size of this process (kilobytes on Linux).
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def peak_tensor_gib(device: torch.device, tracker: TensorMemory | None) -> float | None:
    """Peak bytes of live tensors: CUDA's allocator peak, or the tracker's count on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / GIB
    return None if tracker is None else tracker.peak / GIB
