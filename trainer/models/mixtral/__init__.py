"""The Mixtral family: Llama's attention and blocks with a sparse mixture of experts in place of each
feed-forward, registered as `model.family=mixtral`. Expert parallel applies to its MoE layers
wherever they are (trainer/parallel/expert_parallel.py finds them by type)."""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

from trainer.config import ModelConfig
from trainer.errors import ConfigError
from trainer.models.llama import UNITS, attention_flops
from trainer.models.llama.hf import attention_names, edge_names
from trainer.models.llama.parallelize import attention_plan, edge_plan
from trainer.models.mixtral import memory
from trainer.models.mixtral.model import Mixtral
from trainer.models.routing import check_hf_routing, check_routing
from trainer.models.spec import HFMapping, ModelSpec, register_family


def tp_plan(sequence_parallel: bool, loss_parallel: bool) -> dict:
    between = Shard(1) if sequence_parallel else Replicate()
    return {
        **edge_plan(sequence_parallel, loss_parallel),
        **attention_plan(sequence_parallel),
        # Each tp rank routes its own slice of the sequence (see expert_parallel.py).
        "layers.*.feed_forward": PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(between,),
                                                    use_local_output=True),
        # Shared experts (if any) are a feed-forward on every token, split as Llama's: the sequence
        # gathered, gate and up column-wise, down row-wise and reduce-scattered back.
        "layers.*.feed_forward.shared": PrepareModuleInput(input_layouts=(between,),
                                                           desired_input_layouts=(Replicate(),)),
        "layers.*.feed_forward.shared.w1": ColwiseParallel(),
        "layers.*.feed_forward.shared.w3": ColwiseParallel(),
        "layers.*.feed_forward.shared.w2": RowwiseParallel(output_layouts=between),
    }


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """As Llama's, with top_k routed and the shared experts' feed-forwards per token and the router."""
    attention, scores = attention_flops(cfg, seq_len)
    ffn = 3 * cfg.dim * cfg.ffn_dim * (cfg.top_k + cfg.n_shared_experts) + cfg.dim * cfg.n_experts
    return 6 * (cfg.n_layers * (attention + ffn) + cfg.dim * cfg.vocab_size) + cfg.n_layers * scores


def check(cfg: ModelConfig) -> None:
    """The rules of every MoE family's config."""
    if cfg.n_experts < 1:
        raise ConfigError(f"model.n_experts={cfg.n_experts} must be >= 1 for model.family={cfg.family}")
    if not 1 <= cfg.top_k <= cfg.n_experts:
        raise ConfigError(f"model.top_k={cfg.top_k} must be between 1 and model.n_experts={cfg.n_experts}")
    if cfg.capacity_factor is not None and cfg.capacity_factor <= 0:
        raise ConfigError(f"model.capacity_factor={cfg.capacity_factor} must be > 0, or null for dropless routing")
    check_routing(cfg)


def checkpoint_regions(block: nn.Module) -> list[nn.Module]:
    moe = block.feed_forward
    return [block.attention, moe.experts, *([moe.shared] if moe.shared is not None else [])]


def hf_names(cfg: ModelConfig) -> dict[str, str | list[str]]:
    """Experts are stored one tensor per expert (block_sparse_moe.experts.E.w1/w2/w3, the layout on
    disk of every transformers version); ours are stacked along a first experts dimension."""
    sources: dict[str, str | list[str]] = edge_names(cfg)
    for i in range(cfg.n_layers):
        sources |= attention_names(i)
        moe = f"model.layers.{i}.block_sparse_moe"
        sources[f"layers.{i}.feed_forward.router.weight"] = f"{moe}.gate.weight"
        for w in ("w1", "w2", "w3"):
            sources[f"layers.{i}.feed_forward.experts.{w}"] = [f"{moe}.experts.{e}.{w}.weight"
                                                               for e in range(cfg.n_experts)]
    return sources


def hf_config(cfg: ModelConfig, common: dict):
    from transformers import MixtralConfig

    check_hf_routing(cfg, "Mixtral")
    return MixtralConfig(num_local_experts=cfg.n_experts, num_experts_per_tok=cfg.top_k,
                         router_aux_loss_coef=cfg.aux_loss_coef, **common)


HF = HFMapping(
    model_type="mixtral", architecture="MixtralForCausalLM",
    config_fields=lambda hf: {"n_experts": hf["num_local_experts"], "top_k": hf["num_experts_per_tok"],
                              "aux_loss_coef": hf.get("router_aux_loss_coef", 0.0)},
    config=hf_config, names=hf_names,
)

SPEC = register_family(ModelSpec(family="mixtral", model=Mixtral, **UNITS, tp_plan=tp_plan,
                                 flops_per_token=flops_per_token,
                                 activation_bytes=memory.activation_bytes, selective_bytes=memory.selective_bytes,
                                 check=check, hf=HF, checkpoint_regions=checkpoint_regions))
