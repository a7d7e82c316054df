"""Host offload (`training.offload`): what lives in host memory instead of the device's.

- `optimizer`: FSDP's own offload (trainer/parallel/fsdp.py): the sharded fp32 weights, their
  gradients and the optimizer's state on the host, where the optimizer steps.
- `activations`: what each block saves for backward is copied to host memory as forward saves it and
  copied back in backward, the previous block's while this block's backward runs (on a GPU, on a
  stream of its own beside the compute, into pinned memory). Parameters (and views of them) stay
  where they are: FSDP gathers them again for backward. On the CPU the host is the device: the same
  copies run and the gradients are the same bits.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from trainer.tensors import note_host_copy

OFFLOADS = ("none", "optimizer", "activations")
# Tensors smaller than this stay on the device: a copy's launch costs more than their bytes.
SMALLEST = 1024


class _Block:
    """One forward call of a block: its saved tensors (weakly) and the call before it."""

    def __init__(self, previous: _Block | None):
        self.saved: list[weakref.ref] = []
        self.previous = weakref.ref(previous) if previous is not None else lambda: None
        self.in_backward = False


class _Saved:
    """A tensor saved for backward, held on the host until backward needs it."""

    __slots__ = ("host", "device", "back", "ready", "block", "__weakref__")

    def __init__(self, host: torch.Tensor, device: torch.device, block: _Block):
        self.host, self.device, self.block = host, device, block
        self.back: torch.Tensor | None = None  # the copy back, once started
        self.ready = None  # (CUDA) the event the copy back records


class ActivationOffload:
    """Per block: the saved-tensor hooks that move what the block saves to the host and back."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.last: weakref.ref = lambda: None  # the latest block call
        self.hooks: list = []  # the open saved-tensor hook contexts

    def attach(self, blocks: list[nn.Module]) -> None:
        for block in blocks:
            block.register_forward_pre_hook(self._enter)
            block.register_forward_hook(self._leave)

    def _enter(self, module, args) -> None:
        block = _Block(self.last())
        self.last = weakref.ref(block)
        context = torch.autograd.graph.saved_tensors_hooks(
            lambda t: self._pack(t, block), self._unpack)
        context.__enter__()
        self.hooks.append(context)

    def _leave(self, module, args, output) -> None:
        self.hooks.pop().__exit__(None, None, None)

    def _pack(self, tensor: torch.Tensor, block: _Block):
        base = tensor if tensor._base is None else tensor._base
        if (type(tensor) is not torch.Tensor or (base.grad_fn is None and base.requires_grad)
                or tensor.numel() < SMALLEST or tensor.device.type != self.device.type):
            # a weight (FSDP gathers it again; under tensor parallel a DTensor), a small tensor
            return tensor
        host = torch.empty_like(tensor, device="cpu", pin_memory=self.cuda)
        note_host_copy(host)
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                host.copy_(tensor, non_blocking=True)
            tensor.record_stream(self.stream)  # its memory is not reused before the copy is done
        else:
            host.copy_(tensor)
        saved = _Saved(host, tensor.device, block)
        block.saved.append(weakref.ref(saved))
        return saved

    def _unpack(self, saved):
        if not isinstance(saved, _Saved):
            return saved
        block = saved.block
        if not block.in_backward or saved.back is None:  # the first its backward needs
            block.in_backward = True
            self._fetch(block)
            previous = block.previous()
            if previous is not None:
                self._fetch(previous)  # ahead of the next block's backward
        tensor, saved.back = saved.back, None
        if self.cuda:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(saved.ready)
            tensor.record_stream(current)
        return tensor

    def _fetch(self, block: _Block) -> None:
        """Starts copying `block`'s saved tensors back to the device."""
        for ref in block.saved:
            saved = ref()
            if saved is None or saved.back is not None:
                continue
            if self.cuda:
                with torch.cuda.stream(self.stream):
                    saved.back = saved.host.to(saved.device, non_blocking=True)
                    saved.ready = torch.cuda.Event()
                    saved.ready.record(self.stream)
            else:  # (a copy, as on a GPU: the device's memory count sees the fetched blocks)
                saved.back = saved.host.clone()
