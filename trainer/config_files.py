"""Where the configs live and how Hydra finds them: the config and recipe folders, the schema's
registration in Hydra's ConfigStore (so a misspelt key or a value of the wrong type fails at
composition time, naming the key), and a model config read by name."""

from __future__ import annotations

from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from trainer.config import JobConfig, ModelConfig
from trainer.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parent.parent
CONFIG_DIR = REPO_ROOT / "configs"
RECIPE_DIR = REPO_ROOT / "recipes"


def register_configs() -> None:
    """Registers the schema and the recipes with Hydra.

    Recipes live in the top-level `recipes/` folder but are selected as the group
    `recipe` (`+recipe=NAME`), so each file is stored in the ConfigStore under that group.
    """
    if not OmegaConf.has_resolver("recipe_name"):
        OmegaConf.register_new_resolver("recipe_name", _recipe_name)
    cs = ConfigStore.instance()
    cs.store(name="job_schema", node=JobConfig)
    for path in sorted(RECIPE_DIR.glob("*.yaml")):
        cs.store(group="recipe", name=path.stem, node=OmegaConf.load(path), package="_global_")


def _recipe_name() -> str:
    """The recipe chosen with +recipe=NAME, the default run name; "default" without one."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return "default"
    return HydraConfig.get().runtime.choices.get("recipe") or "default"


def load_model_config(name: str) -> ModelConfig:
    """The model config named `name` (a file in configs/model/), checked against the schema."""
    path = CONFIG_DIR / "model" / f"{name}.yaml"
    if not path.exists():
        known = sorted(p.stem for p in path.parent.glob("*.yaml"))
        raise ConfigError(f"model={name} is not a known model; choose one of {known}")
    node = OmegaConf.load(path)
    node.pop("defaults", None)
    merged = OmegaConf.merge(OmegaConf.structured(ModelConfig), node)
    return OmegaConf.to_object(merged)
