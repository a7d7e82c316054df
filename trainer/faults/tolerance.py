"""Per-step fault tolerance across replica groups, through torchft.

The data-parallel replicas (`parallel.dp_replicate` of them) run as separate jobs, the replica
groups: each is an ordinary torchrun job of dp_shard x cp x tp x pp ranks with FSDP inside it.
torchft's lighthouse decides before each step which groups take part (a quorum); rank r of each
group all-reduces its gradient shards with rank r of the others over a process group torchft
rebuilds when the quorum changes. A group that dies costs the others one retried step, not a
restart; one that (re)joins receives the weights, optimizer state and step from a peer over the
network (no checkpoint is read) and trains the same step as everyone else.

The whole global batch is trained while groups are out (`keep_global_batch`): a step's batch is
`dp_replicate` replica shares, and the groups in the quorum split the shares among them, each
training its shares one after another (accumulating), so the step's samples, their order and its
gradient do not depend on who is alive.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from urllib.parse import urlparse

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from trainer.config.schema import FaultToleranceConfig, JobConfig
from trainer.errors import ConfigError
from trainer.faults.ft_transport import safe_transport
from trainer.float8 import plain
from trainer.tensors import local_tensor

INSTALL = 'pip install -e ".[ft]"'
# Gradients all-reduced across groups at once: the fp32 copy the all-reduce needs is this large.
BUCKET_BYTES = 256 * 2**20


def torchft():
    """The torchft module, imported with its per-step logging turned down; a config error naming the
    install command if it is missing."""
    os.environ.setdefault("RUST_LOG", "warn")  # the lighthouse client logs every quorum at info
    try:
        import torchft
    except ImportError:
        raise ConfigError(f"fault_tolerance.enabled=true needs torchft: {INSTALL}") from None
    # torchft logs a failed collective with its traceback
    # on every rank; the loop says it in one line.
    logging.getLogger("torchft").setLevel(logging.CRITICAL)
    # a peer's state, read once
    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    return torchft


def lighthouse_address(ft) -> str | None:
    return ft.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE") or None


def check_available(ft: FaultToleranceConfig) -> None:
    """What fault tolerance needs beyond its keys (rules.py checks those): torchft, and a
    lighthouse's address (the key or $TORCHFT_LIGHTHOUSE)."""
    torchft()
    if lighthouse_address(ft) is None:
        raise ConfigError("fault_tolerance.lighthouse is not set (nor $TORCHFT_LIGHTHOUSE): the "
                          "lighthouse's address, e.g. http://localhost:29510 (scripts/ft_local.sh "
                          "starts one)")


def check_lighthouse(job: JobConfig) -> None:
    """Under fault tolerance, a config error unless the lighthouse listens within
    distributed.timeout_s (what the job needs of the world outside it; the config rules above need
    nothing)."""
    if not job.fault_tolerance.enabled:
        return
    address, timeout_s = lighthouse_address(job.fault_tolerance), job.distributed.timeout_s
    url = urlparse(address if "://" in address else f"http://{address}")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((url.hostname, url.port or 29510),
                                     timeout=min(5.0, timeout_s)).close()
            return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise ConfigError(f"fault_tolerance.lighthouse={address} cannot be reached "
                                  f"({e.strerror or e}) within distributed.timeout_s={timeout_s}: "
                                  "start the lighthouse first (torchft_lighthouse; "
                                  "scripts/ft_local.sh starts one)") from None
            time.sleep(0.5)


def group_view(job: JobConfig) -> JobConfig:
    """The job as one replica group sees it: no replicate dimension in its mesh, and its share of
    the global batch (what the layout rules and the memory plan check)."""
    if not job.fault_tolerance.enabled:
        return job
    groups = job.parallel.dp_replicate
    return dataclasses.replace(
        job, parallel=dataclasses.replace(job.parallel, dp_replicate=1),
        training=dataclasses.replace(job.training,
                                     global_batch_size=job.training.global_batch_size // groups))


def group_output_dir(job: JobConfig) -> str:
    """Where this replica group writes its metrics, logs and checkpoints: a folder of its own in the
    job's output_dir (each group is a job with its own lock and config)."""
    if not job.fault_tolerance.enabled:
        return job.output_dir
    return os.path.join(job.output_dir, f"replica_group_{job.fault_tolerance.replica_group}")


class OneGroup:
    """The job as one replica group (fault tolerance off): every step trains the whole batch here,
    and commits. What the loop asks of the replica groups, around each step."""

    def start_step(self) -> list[int] | None:
        """The replica shares of the global batch this group trains in the next step (None: the
        whole batch, there being one group)."""
        return None

    def reduce(self, parameters, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def shares(self) -> int:
        """The replica shares of the global batch that reduce() averages over."""
        return 1

    def sum_counts(self, count: torch.Tensor) -> torch.Tensor:
        """`count` (this group's) summed over the groups of the step."""
        return count

    def saves_checkpoints(self) -> bool:
        return True

    def commit(self, update: Callable[[], None]) -> bool:
        """Runs `update` (the optimizer step) when every group finished the step; whether it ran
        (else the step is trained again)."""
        update()
        return True

    def close(self) -> None:
        pass


class ReplicaGroups(OneGroup):
    """This rank's side of torchft's manager: the quorum at the start of each step, the gradient
    all-reduce across groups, and the commit before the optimizer steps. `first_quorum(received)`
    runs once, after the first quorum (`received`: whether a peer group's state came in it)."""

    def __init__(self, job: JobConfig, model: nn.Module, optimizer: torch.optim.Optimizer,
                 trainer_state, device: torch.device, log, mark=lambda phase: None,
                 first_quorum: Callable[[bool], None] = lambda received: None):
        ft, tf = job.fault_tolerance, torchft()
        self.groups, self.group, self.keep = (job.parallel.dp_replicate, ft.replica_group,
                                              ft.keep_global_batch)
        # mark: the watchdog's phase
        self.model, self.optimizer, self.log, self.mark = model, optimizer, log, mark
        # (get, set) of what else a recovering group needs: the step and the data's stream position.
        self.trainer_state = trainer_state
        self.first_quorum: Callable[[bool], None] | None = first_quorum
        timeout = timedelta(seconds=ft.timeout_s)
        pg = (tf.ProcessGroupNCCL(timeout=timeout) if device.type == "cuda"
              else tf.ProcessGroupGloo(timeout=timeout))
        self.manager = tf.Manager(
            pg=pg, min_replica_size=ft.min_replicas, load_state_dict=self._load,
            state_dict=self._state,
            # The quorum is known before the step's data is chosen, and a recovering group is whole
            # before its forward: both need the quorum at the start of the step, not during it.
            use_async_quorum=False,
            # Every group initializes the same weights from
            # the seed, or resumes the same checkpoint.
            init_sync=False,
            replica_id=f"replica_group_{self.group}", lighthouse_addr=lighthouse_address(ft),
            checkpoint_transport=safe_transport(lighthouse_address(ft), timeout),
            timeout=timeout, quorum_timeout=timedelta(seconds=ft.quorum_timeout_s),
            connect_timeout=timedelta(seconds=job.distributed.timeout_s))
        self.recovered = False  # whether the last quorum brought a peer group's state
        self.said = (self.groups, True)

    def set_step(self, step: int) -> None:
        """The step a resumed checkpoint left off at: the quorum compares it across groups."""
        self.manager.load_state_dict({"step": step, "batches_committed": step * self.groups})

    def start_step(self) -> list[int]:
        """The quorum for the next step (recovering from a peer first if this group is behind: the
        trainer's step moves); returns the replica shares of the global batch this group trains in
        it."""
        self.recovered = False
        self.mark("quorum")
        started = time.perf_counter()
        self.manager.start_quorum()  # a group behind the others receives their state in it (_load)
        if self.recovered:
            self.log("fault tolerance: recovered from a peer group at step "
                     f"{self.trainer_state[0]()['step']} in {time.perf_counter() - started:.2f}s "
                     "(quorum, transfer and load of the weights, optimizer state and step; no "
                     "checkpoint read)")
        if self.first_quorum is not None:
            self.first_quorum(self.recovered)
            self.first_quorum = None
        n, rank = self.manager.num_participants(), self.manager.participating_rank()
        if rank is None:  # healing failed or no room: train nothing, commit nothing
            shares = []
        elif self.keep:
            shares = [share for share in range(self.groups) if share % n == rank]
        else:
            shares = [self.group]
        if (n, self.keep) != self.said:
            self.said = (n, self.keep)
            what = ("the whole global batch" if self.keep
                    else f"{n} of {self.groups} shares of the global batch")
            self.log(f"fault tolerance: {n} of {self.groups} replica groups in this step; it "
                     f"trains {what}")
        return shares

    def reduce(self, parameters, loss: torch.Tensor) -> torch.Tensor:
        """Sums the groups' gradient shards and losses across groups into the mean over the global
        batch's replica shares; returns the reduced loss. Buckets of BUCKET_BYTES, one after
        another: the extra memory is one bucket's fp32 copy, whatever the model's size."""
        parameters = list(parameters)
        for p in parameters:  # a group that trained nothing this step still sends its (zero) share
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [_local(p.grad) for p in parameters]
        shares = self.shares()
        loss = loss.detach().float().reshape(1)
        for i, bucket in enumerate(_buckets(grads, BUCKET_BYTES // 4)):
            flat = torch.cat([g.reshape(-1).float() for g in bucket] + ([loss] if i == 0 else []))
            self.manager.allreduce(flat, reduce_op=dist.ReduceOp.SUM).wait()
            flat /= shares
            offset = 0
            for g in bucket:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
            if i == 0:
                loss = flat[-1:].clone()
        return loss.reshape(())

    def shares(self) -> int:
        return self.groups if self.keep else max(self.manager.num_participants(), 1)

    def sum_counts(self, count: torch.Tensor) -> torch.Tensor:
        """Every group calls it each step, one that trains nothing too (with 0), before any
        forward."""
        total = count.detach().clone().reshape(1)
        self.manager.allreduce(total, reduce_op=dist.ReduceOp.SUM).wait()
        return total.reshape(())

    def saves_checkpoints(self) -> bool:
        """One group saves the job's checkpoints: the first of the step's quorum."""
        return self.manager.participating_rank() == 0

    def commit(self, update: Callable[[], None]) -> bool:
        if self.manager.should_commit():
            update()
            return True
        error = self.manager.errored()
        why = (str(error.original_exception).splitlines()[0][:200] if error is not None
               else "a group did not commit")
        self.log(f"fault tolerance: the step failed across replica groups ({why}); training it "
                 "again")
        return False

    def close(self) -> None:
        self.manager.shutdown(wait=False)

    # What a recovering group receives from a peer: this rank's shards of the weights and optimizer
    # state (the groups share a layout, so rank r's shards are rank r's everywhere), and the step.

    def _state(self) -> dict:
        params = list(self.model.parameters())
        optim = [{k: _local(v) for k, v in self.optimizer.state[p].items()}
                 if p in self.optimizer.state else None
                 for p in params]
        return {"params": [_local(p) for p in params], "optimizer": optim,
                "trainer": self.trainer_state[0]()}

    def _load(self, state: dict) -> None:
        with torch.no_grad():
            for p, value, saved in zip(self.model.parameters(), state["params"],
                                       state["optimizer"]):
                _local(p).copy_(value)
                if saved is None:
                    self.optimizer.state.pop(p, None)
                elif p in self.optimizer.state:
                    for k, v in saved.items():
                        _local(self.optimizer.state[p][k]).copy_(v)
                else:
                    self.optimizer.state[p] = {k: _like(p, v) for k, v in saved.items()}
        self.trainer_state[1](state["trainer"])
        self.recovered = True


def _buckets(tensors: list[torch.Tensor], elements: int) -> list[list[torch.Tensor]]:
    """`tensors` in order, in runs of about `elements` elements (a larger tensor is a run of its
    own)."""
    buckets: list[list[torch.Tensor]] = [[]]
    size = 0
    for t in tensors:
        if buckets[-1] and size + t.numel() > elements:
            buckets.append([])
            size = 0
        buckets[-1].append(t)
        size += t.numel()
    return buckets


def _local(t: torch.Tensor) -> torch.Tensor:
    return local_tensor(plain(t))  # (a float8 weight's plain tensor)


def _like(p: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """An optimizer state tensor for parameter `p` from its local shard `value` (a scalar stays
    plain)."""
    value = value.to(p.device).clone()
    if isinstance(p, DTensor) and value.ndim > 0:
        return DTensor.from_local(value, p.device_mesh, p.placements, run_check=False,
                                  shape=p.shape, stride=p.stride())
    return value
