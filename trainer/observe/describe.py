"""The start-up lines that say how the job is laid out, how much of the model a rank holds and,
under LoRA, what trains."""

from __future__ import annotations

from trainer.config.schema import ModelConfig
from trainer.models import build_model, family
from trainer.models.attention import kv_copies
from trainer.models.lora import LoraOptions, add_adapters
from trainer.models.moe import GroupedExperts
from trainer.parallel.dims import ParallelDims


def describe_layout(dims: ParallelDims) -> str:
    """The mesh's degrees, in order: `mesh pp=1, dp_replicate=1, dp_shard=4, cp=1, tp=1`."""
    names = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    degrees = {name: str(getattr(dims, name)) for name in names}
    if dims.cp_ulysses > 1:  # Ulysses alone, or the hybrid's two parts
        degrees["cp"] += (f" (cp_ulysses={dims.cp}" if dims.cp_ring == 1 else
                          f" (cp_ring={dims.cp_ring} x cp_ulysses={dims.cp_ulysses}") + ")"
    experts = f" (ep={dims.ep} over dp_shard x cp)" if dims.ep_enabled else ""
    return "mesh " + ", ".join(f"{name}={value}" for name, value in degrees.items()) + experts


def describe_ulysses(model: ModelConfig, dims: ParallelDims) -> str | None:
    """Under Ulysses, when its ranks outnumber a tp rank's key/value heads: how often each is
    repeated, and what that costs (None otherwise)."""
    kv_heads = model.n_kv_heads // dims.tp
    copies = kv_copies(kv_heads, dims.cp_ulysses)
    if dims.cp_ulysses == 1 or copies == 1:
        return None
    return (f"cp: Ulysses over {dims.cp_ulysses} ranks repeats each of the {kv_heads} key/value "
            f"heads {copies}x (each rank takes whole ones): its all-to-all sends {copies}x the "
            "keys and values, and attention holds them repeated")


def describe_share(dims: ParallelDims, total: int, held: int, held_mib: float) -> str:
    """How much of its model (its stages, under pipeline parallel) rank 0 holds."""
    scope = "rank 0's stages" if dims.pp_enabled else "the model"
    return (f"{scope}: {total / 1e6:.2f}M parameters, rank 0 holds {held / 1e6:.2f}M "
            f"({held_mib:.1f} MiB, 1/{total / held:.2f})")


def describe_lora(model: ModelConfig, options: LoraOptions) -> str:
    """What LoRA trains of the whole model: its layers, and the share of the parameters."""
    whole = build_model(model, device="meta")
    names = add_adapters(whole, options, family(model.family).blocks)
    trained = sum(p.numel() for p in whole.parameters() if p.requires_grad)
    total = sum(p.numel() for p in whole.parameters())
    kinds = ", ".join(dict.fromkeys(name.rpartition(".")[2] for name in names))
    adapted = sum(whole.get_submodule(name).weight.numel() for name in names)
    experts = any(isinstance(m, GroupedExperts) for m in whole.modules())
    return (f"peft: LoRA rank {options.rank}, alpha {options.alpha:g} on {len(names)} linear "
            f"layers ({kinds}): {trained / 1e6:.3f}M of {total / 1e6:.2f}M parameters train "
            f"({100 * trained / total:.2f}%), the rest frozen"
            + (f", {adapted / 1e6:.2f}M of them in 4-bit nf4" if options.base_dtype else "")
            + ("; the routed experts take no adapters" if experts else ""))
