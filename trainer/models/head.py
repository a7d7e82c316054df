"""The output projection and the loss, computed together a chunk of tokens at a time.

`LMHead` is the final projection of every family: given labels it returns the mean cross-entropy
(in the trainer, the sum of the token losses) instead of the logits, and no [tokens, vocabulary]
tensor is ever whole. Each chunk's logits are computed in the compute dtype, turned into fp32
log-sum-exps and the gradient of the loss, and freed before the next chunk: the gradients of the
input and of the weight are computed in forward (their GEMMs in the compute dtype, the weight's
accumulated in fp32) and scaled in backward, so nothing of the size of the logits is saved and no
matmul runs twice.

Under tensor parallel with the vocabulary split (LMHeadParallel), each rank holds its shard's rows
of the weight: per chunk the ranks exchange their log-sum-exps (one all-gather of a [chunk] vector)
and, once per microbatch, the target logits (one all-reduce); the input's gradient is a partial sum
that tensor parallel's layout reduces.
"""

from __future__ import annotations

from functools import cache

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard

IGNORE_INDEX = -100  # labels to leave out of the loss (F.cross_entropy's default)


class LMHead(nn.Linear):
    """The output projection [dim -> vocabulary], without bias. `forward(h)` returns the logits;
    `forward(h, labels)` the mean cross-entropy over the labels that are not IGNORE_INDEX, with the
    logits computed `chunk_tokens` tokens at a time. None: the plain loss, F.cross_entropy on the
    whole logits (under loss parallel, where those are split on the vocabulary: all tokens in one
    chunk)."""

    def __init__(self, dim: int, vocab_size: int, chunk_tokens: int | None = 2048, **kwargs):
        super().__init__(dim, vocab_size, bias=False, **kwargs)
        self.chunk_tokens = chunk_tokens
        self.compiled = False  # the chunks' elementwise work through torch.compile (set_loss_chunk)
        self.summed = False  # the sum of the token losses instead of their mean (sum_token_losses)

    def forward(self, h: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        weight, group = self.weight, None
        # tensor parallel: this rank's rows, and the group sharing them
        if isinstance(weight, DTensor):
            if weight.placements[0] == Shard(0):
                group = weight.device_mesh.get_group()
            weight = weight.to_local()
        if labels is None:
            # this rank's vocabulary shard of the logits under tensor parallel
            return F.linear(h, weight)
        if self.chunk_tokens is None and group is None:  # the plain loss, on whole logits
            return F.cross_entropy(F.linear(h, weight).flatten(0, -2).float(), labels.flatten(),
                                   reduction="sum" if self.summed else "mean")
        chunk = self.chunk_tokens or labels.numel()
        # (Function.forward runs without grad mode: whether gradients are wanted is decided here.)
        grads = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
        return LinearCrossEntropy.apply(h.flatten(0, -2), weight, labels.flatten(), chunk, group,
                                        grads, self.compiled, self.summed)


def set_loss_chunk(model: nn.Module, tokens: int | None, compiled: bool = False) -> None:
    """Every LMHead of `model` computes its loss `tokens` tokens at a time (None: all at once), the
    elementwise work of each chunk fused by torch.compile when `compiled`."""
    for module in model.modules():
        if isinstance(module, LMHead):
            module.chunk_tokens = tokens
            module.compiled = compiled


def sum_token_losses(model: nn.Module) -> None:
    """Every LMHead of `model` returns the sum of its token losses, not their mean: the trainer
    divides by the step's supervised tokens over every rank and microbatch
    (trainer.run.passes.supervised_scale)."""
    for module in model.modules():
        if isinstance(module, LMHead):
            module.summed = True


def _lse_and_target(logits: torch.Tensor, local: torch.Tensor, here: torch.Tensor):
    """A chunk's fp32 log-sum-exp over its vocabulary columns and each row's label logit (0 where
    the label is not among the columns)."""
    logits = logits.float()
    target = logits.gather(1, local[:, None]).squeeze(1)
    return logits.logsumexp(dim=-1), torch.where(here, target, 0.0)


def _loss_gradient(logits: torch.Tensor, lse: torch.Tensor, local: torch.Tensor, here: torch.Tensor,
                   valid: torch.Tensor) -> torch.Tensor:
    """d(sum of losses)/d(logits) = softmax - one_hot(label) on the valid rows, in the logits'
    dtype: the form torch.compile fuses into one pass over the logits."""
    columns = torch.arange(logits.shape[1], device=logits.device)
    label = (columns[None, :] == local[:, None]) & here[:, None]
    grad = (logits.float() - lse[:, None]).exp() - label.float()
    return torch.where(valid[:, None], grad, 0.0).to(logits.dtype)


def _loss_gradient_in_place(logits: torch.Tensor, lse: torch.Tensor, local: torch.Tensor,
                            here: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The same in place of fp32 logits: uncompiled, no second [chunk, vocabulary] tensor."""
    grad = logits.sub_(lse[:, None]).exp_()
    grad[torch.arange(len(local), device=grad.device), local] -= here.float()
    return grad.mul_(valid[:, None])


@cache
def _compiled(fn):
    # One graph per chunk shape (a microbatch's short last chunk is a second one).
    return torch.compile(fn, dynamic=False)


def _add_product(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """out += a @ b, `out` fp32 and a, b perhaps in a lower precision, accumulated in fp32."""
    if out.dtype == a.dtype:
        out.addmm_(a, b)
    elif out.is_cuda:  # cuBLAS adds the product into fp32 without a rounded copy
        torch.addmm(out, a, b, out_dtype=out.dtype, out=out)
    else:  # (no mixed-dtype addmm on the CPU)
        out += a @ b


class LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int, group,
                want_grads: bool, compiled: bool = False, summed: bool = False) -> torch.Tensor:
        tokens, vocab = h.shape[0], weight.shape[0]
        # this shard's first vocabulary id
        first = dist.get_rank(group) * vocab if group is not None else 0
        local = labels - first
        here = (local >= 0) & (local < vocab)
        local = torch.where(here, local, 0)
        valid = labels != IGNORE_INDEX
        count = valid.sum()
        lse_and_target, loss_gradient = ((_compiled(_lse_and_target), _compiled(_loss_gradient))
                                         if compiled
                                         else (_lse_and_target, _loss_gradient_in_place))
        lse = torch.empty(tokens, dtype=torch.float32, device=h.device)
        target = torch.empty(tokens, dtype=torch.float32, device=h.device)
        grad_h = torch.empty_like(h) if want_grads else None
        grad_w = (torch.zeros(weight.shape, dtype=torch.float32, device=h.device) if want_grads
                  else None)
        for start in range(0, tokens, chunk):
            end = min(start + chunk, tokens)
            x, rows = h[start:end], slice(start, end)
            logits = x @ weight.t()
            if not compiled:
                logits = logits.float()  # (and the compute dtype's copy freed)
            chunk_lse, target[rows] = lse_and_target(logits, local[rows], here[rows])
            if group is not None:  # the log-sum-exp over the whole vocabulary, from every shard's
                shards = torch.empty(dist.get_world_size(group) * (end - start),
                                     dtype=torch.float32, device=h.device)
                _all_gather(shards, chunk_lse, group)
                chunk_lse = shards.view(-1, end - start).logsumexp(dim=0)
            lse[rows] = chunk_lse
            if want_grads:
                # The mean's 1/count and the upstream gradient are applied in backward.
                grad = loss_gradient(logits, chunk_lse, local[rows], here[rows], valid[rows])
                grad = grad.to(h.dtype)
                del logits
                torch.mm(grad, weight, out=grad_h[rows])
                _add_product(grad_w, grad.t(), x)
        if group is not None:
            dist.all_reduce(target, group=group)  # each label's logit lives on one shard
        count = torch.ones_like(count) if summed else count.clamp(min=1)
        loss = torch.where(valid, lse - target, 0.0).sum() / count
        if want_grads:
            ctx.save_for_backward(grad_h, grad_w, count)
            ctx.dtypes = (h.dtype, weight.dtype)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grad_h, grad_w, count = ctx.saved_tensors
        # applied in fp32: a bf16 scale would bias every gradient alike
        scale = grad_loss.float() / count
        h_dtype, w_dtype = ctx.dtypes
        # Out of place: a zero-bubble schedule runs this
        # backward twice (input, then weight gradients).
        grads = (grad_h.float() * scale).to(h_dtype), (grad_w * scale).to(w_dtype)
        return *grads, None, None, None, None, None, None


def _all_gather(out: torch.Tensor, tensor: torch.Tensor, group) -> None:
    # torch 2.13 renames all_gather_into_tensor (and warns
    # on the old name); older ones lack the new one.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, tensor, group=group)
