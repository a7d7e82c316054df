"""Measured memory: the peak bytes of live tensors on this rank, and the process's peak.

On CUDA the caching allocator counts tensor bytes itself. On the CPU nothing does, so
`TensorMemory` watches every operator's outputs (a dispatch mode on the training thread) and
counts each new storage's bytes until the storage is freed: what the plan's prediction is held
against. Storages are counted once however many views share them; a DTensor counts its local shard.
FSDP frees and re-allocates its gathered parameters by resizing their storages in place, which no
operator shows, so while a tracker is active storage resizes are counted too. The count costs
Python work per operator, so training runs it for its first `COUNTED_STEPS` steps only.
"""

from __future__ import annotations

import resource
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

from trainer.step_parts import StepPart
from trainer.tensors import HOST_COPY_LISTENERS

GIB = 2**30
# Steps the CPU's count runs for: the second holds all a step ever holds (the optimizer's state
# exists from the first update on), and the steps after it run at full speed, uncounted (a
# validation or checkpoint after them is counted on a GPU only).
COUNTED_STEPS = 2
_storage_resize = torch.UntypedStorage.resize_


class TensorMemory(TorchDispatchMode):
    """Live and peak bytes of the tensors created while active (plus those passed to `add`)."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}  # id of a live storage -> its bytes
        self._refs: dict[int, weakref.ref] = {}
        self._active = False
        self._peak_before = 0  # the peak before the latest count raised it

    def add(self, tensors) -> None:
        """Counts tensors made before tracking began (the model's parameters)."""
        for t in tensors:
            self._count(t)

    def reset_peak(self) -> None:
        self.peak = self.live

    def _count(self, t: torch.Tensor) -> None:
        # a DTensor, a float8 tensor: the tensors inside hold the bytes
        if is_traceable_wrapper_subclass(t):
            for inner in (getattr(t, name) for name in t.__tensor_flatten__()[0]):
                if isinstance(inner, torch.Tensor):
                    self._count(inner)
            return
        if t.device.type == "meta":
            return
        storage = t.untyped_storage()
        key = id(storage)
        if key in self._sizes:
            return
        # torch keeps one Python object per live storage,
        # so its weak reference dies with the storage.
        self._refs[key] = weakref.ref(storage, lambda _, key=key: self._free(key))
        self._sizes[key] = 0
        self._resized(key, storage.nbytes())

    def _resized(self, key: int, nbytes: int) -> None:
        self.live += nbytes - self._sizes[key]
        self._sizes[key] = nbytes
        self._peak_before, self.peak = self.peak, max(self.peak, self.live)

    def host_copy(self, t: torch.Tensor) -> None:
        """Sets apart `t`, just made (training.offload=activations' copy in host memory): its bytes
        leave the count, and the peak its allocation set."""
        key = id(t.untyped_storage())
        if key in self._sizes:
            if self.peak == self.live:
                self.peak = self._peak_before
            self.live -= self._sizes[key]
            self._sizes[key] = 0

    def _free(self, key: int) -> None:
        self._refs.pop(key, None)
        self.live -= self._sizes.pop(key, 0)

    def __enter__(self):
        tracker = self

        def resize(storage, nbytes):
            _storage_resize(storage, nbytes)
            if id(storage) in tracker._sizes:
                tracker._resized(id(storage), storage.nbytes())

        torch.UntypedStorage.resize_ = resize
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = _storage_resize
        return super().__exit__(*exc)

    def start(self) -> None:
        """Counts from now on, on this thread, until `stop`."""
        self.__enter__()
        self._active = True
        HOST_COPY_LISTENERS.append(self.host_copy)

    def stop(self) -> None:
        """Stops counting (once; later calls do nothing). The peak so far is kept."""
        if self._active:
            self._active = False
            HOST_COPY_LISTENERS.remove(self.host_copy)
            self.__exit__(None, None, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._count(t)
        return out


def peak_memory_gib(device: torch.device) -> float:
    """The process's peak: CUDA's reserved bytes (what the allocator held), or the CPU's peak
    RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_reserved(device) / GIB
    # Peak resident set size of this process (kilobytes on Linux).
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def peak_tensor_gib(device: torch.device, tracker: TensorMemory | None) -> float | None:
    """Peak bytes of live tensors: CUDA's allocator peak, or the tracker's count on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / GIB
    return None if tracker is None else tracker.peak / GIB


class MemoryFigures(StepPart):
    """The record's memory figures: the first step's peak on its record, then the peak since it (the
    steady state: the optimizer's state exists from the first update on, and a step then holds it
    beside the activations and gradients), validations and checkpoints included on a GPU.

    On the CPU, live tensors are counted from here (the model's `parameters` first, then all the
    steps make) through the first COUNTED_STEPS steps after `first_step`; blocks run eagerly while
    counted, so a compiled run forgets dynamo's skipped frames then (`on_compiled_again`: the
    watchdog lets the next step compile)."""

    def __init__(self, device: torch.device, parameters, first_step: int, compiled: bool,
                 on_compiled_again):
        self.device = device
        self.tracker = TensorMemory() if device.type == "cpu" else None
        if self.tracker is not None:
            self.tracker.add(parameters)
            self.tracker.start()
        self.first_trained = first_step + 1
        self.since = self.first_trained  # the first step the peaks cover
        self.step, self.first = first_step, None
        self.counted_until = first_step + COUNTED_STEPS
        self.compiled, self.on_compiled_again = compiled, on_compiled_again

    def after_step(self, step: int) -> None:
        self.step = step
        if step == self.first_trained:  # the peaks from here on are the steady state's
            self.first = self.figures()  # (its own record's)
            self.since = step + 1
            if self.tracker is not None:
                self.tracker.reset_peak()
            elif self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)
        if self.tracker is None or step != self.counted_until:
            return
        self.tracker.stop()
        if self.compiled:
            # Dynamo skips a frame under a dispatch mode and remembers the skip: forgotten here, the
            # next step compiles the blocks.
            torch.compiler.reset()
            self.on_compiled_again()

    def figures(self) -> dict:
        return {"mem_gib": peak_memory_gib(self.device),
                "mem_tensor_gib": peak_tensor_gib(self.device, self.tracker),
                "mem_since_step": self.since}

    def record(self) -> dict:
        return self.first if self.step == self.first_trained else self.figures()

    def close(self) -> None:
        if self.tracker is not None:
            self.tracker.stop()
