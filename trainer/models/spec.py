"""A model family as one object: what the parallel code, the checkpoint converters, the metrics and
the config checks need to know about it, registered once under its `model.family` name.

The parallel code names no module of any family: it asks the family's spec where its blocks, its
embedding and its head are, and applies the tensor-parallel plan the spec writes as data.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from trainer.config.schema import ModelConfig
from trainer.errors import ConfigError
from trainer.models.costs import Costs


@dataclass(frozen=True)
class HFMapping:
    """How a family reads and writes transformers' directories (config.json + safetensors).

    `config_fields(hf)`: the family's own ModelConfig fields from a config.json (the fields every
    decoder shares are read by trainer/checkpoint/hf.py); `config(cfg, common)`: a transformers
    config object, given those shared keyword arguments; `names(cfg)`: our weight name -> the
    Hugging Face tensor, or for a tensor we stack (experts) the list of tensors in stacking
    order."""

    model_type: str
    architecture: str
    config_fields: Callable[[dict], dict]
    config: Callable[[ModelConfig, dict], object]
    names: Callable[[ModelConfig], dict[str, str | list[str]]]


def tp_divides(cfg: ModelConfig) -> dict[str, int]:
    """The shared decoder's widths tensor parallel splits: heads and key/value heads, the
    feed-forward."""
    return {"n_heads": cfg.n_heads, "n_kv_heads": cfg.n_kv_heads, "ffn_dim": cfg.ffn_dim}


@dataclass(frozen=True)
class ModelSpec:
    """Everything particular to one model family.

    - `config`: its config class, ModelConfig or a dataclass subclass of it declaring the family's
      own keys (set as model.<key>=..., checked like every key; a field made with
      trainer.config.schema.shape is one a checkpoint must agree on).
    - `model`: the plain-PyTorch model class, built from its config; it defines `init_std(name)`.
      `forward(tokens, positions=None, labels=None)` accepts a stage's inputs (hidden states when it
      has no embedding) and returns hidden states when it has no head; its output projection is an
      LMHead (trainer.models.head), called with the labels: the logits without them, else the loss.
    - `embedding`, `blocks`, `head`: module paths (by default trainer.models.decoder.Decoder's). The
      blocks live in an nn.ModuleDict keyed by their index; the embedding, each block and the head
      (its modules together) are the pipeline and FSDP units, in that order. A stage keeps some of
      them and the others are set to None (removed from the ModuleDict), so parameter names stay
      those of the whole model.
    - `tp_plan(cfg, sequence_parallel, loss_parallel)`: the tensor-parallel plan, module path
      (fnmatch patterns, as torch's parallelize_module takes them) -> ParallelStyle, for the whole
      model; the paths a pipeline stage lacks are left out when it is applied. `tp_divides(cfg)`:
      the keys whose values tensor parallel must divide.
    - `costs`: its FLOPs and memory terms for the plan and the metrics (trainer.models.costs.Costs).
    - `check(cfg)`: the family's config rules (ConfigError); `hf`: its Hugging Face mapping, None if
      it has none.
    - `block_kind(cfg, index)`: blocks of one kind hold the same parameters (DeepSeek-V3's first
      blocks are dense, the others MoE): the memory plan builds one of each kind; by default all
      alike.
    - `adamw_matrices`: the blocks' weight matrices that take AdamW under optim=muon (fnmatch
      patterns of parameter names; the others take Muon): the routers by default.
    - `lora_targets`: the linear layers that take LoRA adapters when peft.target_modules is null
      (fnmatch patterns of module names): the attention and feed-forward projections by default,
      the shared experts' too (a router never does; grouped experts are not linear layers).
    - `checkpoint_regions(block)`: the parts of a block checkpointed each on its own under selective
      activation checkpointing when its experts are an FSDP unit of their own (None: the whole
      block).
    """

    family: str
    model: Callable[[ModelConfig], nn.Module]
    tp_plan: Callable[[ModelConfig, bool, bool], dict]
    costs: Costs
    config: type[ModelConfig] = ModelConfig
    embedding: str = "tok_embeddings"
    blocks: str = "layers"
    head: tuple[str, ...] = ("norm", "output")
    tp_divides: Callable[[ModelConfig], dict[str, int]] = tp_divides
    check: Callable[[ModelConfig], None] = lambda cfg: None
    hf: HFMapping | None = None
    checkpoint_regions: Callable[[nn.Module], list[nn.Module]] | None = None
    block_kind: Callable[[ModelConfig, int], object] = lambda cfg, index: None
    adamw_matrices: tuple[str, ...] = ("*.router.weight",)
    lora_targets: tuple[str, ...] = ("*.attention.w*", "*.feed_forward.w*",
                                     "*.feed_forward.shared.w*")

    def block_name(self, index: int | str) -> str:
        return f"{self.blocks}.{index}"

    def pipeline_units(self, n_layers: int) -> list[str]:
        """The names a pipeline split and `parallel.pp_stage_modules` use, in model order."""
        return [self.embedding, *(self.block_name(i) for i in range(n_layers)), *self.head]

    def is_block(self, unit: str) -> bool:
        return unit.startswith(self.blocks + ".")

    def block_modules(self, model: nn.Module) -> nn.ModuleDict:
        """The model's (or stage's) blocks by index."""
        return model.get_submodule(self.blocks)

    def part(self, model: nn.Module, path: str) -> nn.Module | None:
        """The module at `path`, None where a pipeline stage has removed it."""
        module: nn.Module | None = model
        for name in path.split("."):
            module = getattr(module, name, None)
            if module is None:
                return None
        return module

    def head_modules(self, model: nn.Module) -> list[nn.Module]:
        return [m for m in (self.part(model, path) for path in self.head) if m is not None]


_FAMILIES: dict[str, ModelSpec] = {}


def register_family(spec: ModelSpec) -> ModelSpec:
    """Makes `spec` the family `model.family=<spec.family>` builds; returns it."""
    _FAMILIES[spec.family] = spec
    return spec


def family(name: str) -> ModelSpec:
    """The registered family `name` (a config error naming the key if there is none)."""
    if name not in _FAMILIES:
        raise ConfigError(f"model.family={name} is unknown; choose one of {families()}")
    return _FAMILIES[name]


def families() -> list[str]:
    return sorted(_FAMILIES)


def family_by_hf_type(model_type: str | None) -> ModelSpec | None:
    """The family whose Hugging Face `model_type` this is, if any."""
    return next((s for s in _FAMILIES.values()
                 if s.hf is not None and s.hf.model_type == model_type), None)
