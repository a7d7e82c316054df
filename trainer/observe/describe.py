"""The start-up lines that say how the job is laid out and how much of the model a rank holds."""

from __future__ import annotations

from trainer.parallel.dims import ParallelDims


def describe_layout(dims: ParallelDims) -> str:
    """The mesh's degrees, in order: `mesh pp=1, dp_replicate=1, dp_shard=4, cp=1, tp=1`."""
    names = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    experts = f" (ep={dims.ep} over dp_shard x cp)" if dims.ep_enabled else ""
    return "mesh " + ", ".join(f"{name}={getattr(dims, name)}" for name in names) + experts


def describe_share(dims: ParallelDims, total: int, held: int, held_mib: float) -> str:
    """How much of its model (its stages, under pipeline parallel) rank 0 holds."""
    scope = "rank 0's stages" if dims.pp_enabled else "the model"
    return (f"{scope}: {total / 1e6:.2f}M parameters, rank 0 holds {held / 1e6:.2f}M "
            f"({held_mib:.1f} MiB, 1/{total / held:.2f})")
