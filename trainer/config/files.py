"""Where the configs live and how Hydra finds them: the config and recipe folders, the schema's
registration in Hydra's ConfigStore (so a misspelt key or a value of the wrong type fails at
composition time, naming the key), and a model config read by name."""

from __future__ import annotations

from pathlib import Path

import yaml
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from trainer.config.schema import JobConfig
from trainer.errors import ConfigError, unknown_choice

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIG_DIR = REPO_ROOT / "configs"
RECIPE_DIR = REPO_ROOT / "recipes"
# Recipes whose files do not parse, by name: registered as nothing, said when chosen.
BROKEN_RECIPES: dict[str, ConfigError] = {}


def register_configs() -> None:
    """Registers the schema and the recipes with Hydra.

    Recipes live in the top-level `recipes/` folder but are selected as the group
    `recipe` (`+recipe=NAME`), so each file is stored in the ConfigStore under that group.
    """
    if not OmegaConf.has_resolver("recipe_name"):
        OmegaConf.register_new_resolver("recipe_name", _recipe_name)
    cs = ConfigStore.instance()
    schema = OmegaConf.structured(JobConfig)
    # The model and optim sections take keys beyond the shared ones: the family's or the optimizer's
    # config class types and checks them once the config
    # is composed (trainer.checks.overrides.job_config).
    OmegaConf.set_struct(schema.model, False)
    OmegaConf.set_struct(schema.optim, False)
    cs.store(name="job_schema", node=schema)
    for path in sorted(RECIPE_DIR.glob("*.yaml")):
        try:
            node = OmegaConf.load(path)
        except yaml.YAMLError as e:  # only a command that chooses it fails
            BROKEN_RECIPES[path.stem] = yaml_error(e)
            continue
        cs.store(group="recipe", name=path.stem, node=node, package="_global_")


def yaml_error(e: yaml.YAMLError) -> ConfigError:
    """A config file that does not parse, named with the line and column where the parser
    stopped."""
    mark = getattr(e, "problem_mark", None)
    if mark is None:
        return ConfigError(f"a config file does not parse: {e}")
    path = Path(mark.name)
    shown = path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path
    return ConfigError(f"{shown} does not parse (line {mark.line + 1}, column {mark.column + 1}): "
                       f"{getattr(e, 'problem', None) or e}")


def _recipe_name() -> str:
    """The recipe chosen with +recipe=NAME, the default run name; "default" without one."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return "default"
    return HydraConfig.get().runtime.choices.get("recipe") or "default"


def load_model_file(name: str) -> DictConfig:
    """The model config file `name` (in configs/model/), as written: its family's config class
    types and checks it (trainer.models.model_config)."""
    path = CONFIG_DIR / "model" / f"{name}.yaml"
    if not path.exists():
        known = sorted(p.stem for p in path.parent.glob("*.yaml"))
        raise unknown_choice("model", name, known)
    node = OmegaConf.load(path)
    node.pop("defaults", None)
    return node
