"""The keys of a mixture-of-experts feed-forward, declared once for every family that has one (a
family's config class inherits MoEConfig), their rules, and the MoE layer built from them."""

from __future__ import annotations

from dataclasses import dataclass

from trainer.config.schema import ModelConfig, shape
from trainer.errors import ConfigError
from trainer.models.moe import MoE
from trainer.models.routing import Routing

SCORES = ("softmax", "sigmoid")


@dataclass
class MoEConfig:
    """Experts in place of the feed-forward; each is ffn_dim wide (the shared model key)."""

    n_experts: int = shape(8)
    top_k: int = shape(2)
    aux_loss_coef: float = 0.0  # load-balancing loss (Switch/Mixtral form), averaged over layers
    z_loss_coef: float = 0.0  # router z-loss (ST-MoE), averaged over layers
    # null: dropless. Otherwise each expert takes at most ceil(factor * tokens * top_k / n_experts)
    # slots per forward on each rank; the overflow is dropped and counted.
    capacity_factor: float | None = None
    # Routing (DeepSeek-V3's options). route_score: softmax | sigmoid, the scores the top_k are
    # chosen from and weighted by; route_norm: the chosen weights renormalised to sum to 1;
    # route_scale: then multiplied by this.
    route_score: str = "softmax"
    route_norm: bool = True
    route_scale: float = 1.0
    # experts every token runs beside its routed ones, each ffn_dim wide
    n_shared_experts: int = shape(0)
    # The experts in n_expert_groups groups; each token chooses among the experts of its top_groups
    # groups (a group's score: the sum of its two best experts' scores).
    n_expert_groups: int = 1
    top_groups: int = 1
    # Aux-loss-free balancing: a per-expert bias added to the scores for the choice only, moved by
    # this much after each step towards the even load (0: off).
    bias_update_speed: float = 0.0
    # The bias also where it does not move (DeepSeek-V3's e_score_correction_bias, kept as trained).
    expert_bias: bool = shape(False)

    def moe_layers(self) -> list[int]:
        """The blocks with an MoE layer (by index): all of them, unless a family says otherwise."""
        return list(range(self.n_layers))


def n_experts(cfg: ModelConfig) -> int:
    """The routed experts of a model config's MoE layers; 0 for a dense family."""
    return cfg.n_experts if isinstance(cfg, MoEConfig) else 0


def check_moe(cfg: MoEConfig) -> None:
    """The MoE keys' rules (ConfigError)."""
    if cfg.n_experts < 1:
        raise ConfigError(f"model.n_experts={cfg.n_experts} must be >= 1 for "
                          f"model.family={cfg.family}")
    if not 1 <= cfg.top_k <= cfg.n_experts:
        raise ConfigError(f"model.top_k={cfg.top_k} must be between 1 and "
                          f"model.n_experts={cfg.n_experts}")
    if cfg.capacity_factor is not None and cfg.capacity_factor <= 0:
        raise ConfigError(f"model.capacity_factor={cfg.capacity_factor} must be > 0, or null for "
                          "dropless routing")
    for key in ("aux_loss_coef", "z_loss_coef", "n_shared_experts", "bias_update_speed"):
        if getattr(cfg, key) < 0:
            raise ConfigError(f"model.{key}={getattr(cfg, key)} must be >= 0")
    if cfg.route_score not in SCORES:
        raise ConfigError(f"model.route_score={cfg.route_score} is unknown; choose one of "
                          f"{list(SCORES)}")
    if cfg.route_scale <= 0:
        raise ConfigError(f"model.route_scale={cfg.route_scale} must be > 0")
    groups = cfg.n_expert_groups
    if groups < 1 or cfg.n_experts % groups:
        raise ConfigError(f"model.n_expert_groups={groups} must divide "
                          f"model.n_experts={cfg.n_experts}")
    if not 1 <= cfg.top_groups <= groups:
        raise ConfigError(f"model.top_groups={cfg.top_groups} must be between 1 and "
                          f"model.n_expert_groups={groups}")
    if cfg.top_k > cfg.top_groups * (cfg.n_experts // groups):
        raise ConfigError(f"model.top_k={cfg.top_k} is more than the experts of "
                          f"model.top_groups={cfg.top_groups} groups "
                          f"({cfg.top_groups * (cfg.n_experts // groups)})")


# The routing transformers' Mixtral and Qwen3-MoE compute: any other has no Hugging Face form there.
HF_ROUTING = {"route_score": "softmax", "route_scale": 1.0, "n_shared_experts": 0,
              "n_expert_groups": 1, "bias_update_speed": 0.0, "expert_bias": False}


def check_hf_routing(cfg: MoEConfig, architecture: str, routing: dict = HF_ROUTING) -> None:
    """A config error when the model's MoE keys differ from `routing`, what `architecture`
    computes."""
    for key, value in routing.items():
        if getattr(cfg, key) != value:
            raise ConfigError(f"model.{key}={getattr(cfg, key)}: transformers' {architecture} has "
                              f"no such routing (model.{key}={value}); this model has no Hugging "
                              "Face form")


def moe_from_config(cfg: MoEConfig) -> MoE:
    """A model config's MoE layer. Its auxiliary losses are averaged over the layers, so their
    coefficients do not grow with depth."""
    routing = Routing(score=cfg.route_score, norm=cfg.route_norm, scale=cfg.route_scale,
                      n_groups=cfg.n_expert_groups, top_groups=cfg.top_groups,
                      bias_update_speed=cfg.bias_update_speed, bias=cfg.expert_bias)
    layers = len(cfg.moe_layers())
    return MoE(cfg.dim, cfg.ffn_dim, cfg.n_experts, cfg.top_k, cfg.aux_loss_coef / layers,
               cfg.z_loss_coef / layers, cfg.capacity_factor, routing, cfg.n_shared_experts)
