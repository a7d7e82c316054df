"""The command line's overrides, checked before Hydra composes anything: a group choice that names
no file, and a key the schema does not have (also when added with `+`, which Hydra would accept),
each one `config error:` line with the choices or the nearest known keys (a model key the shared
schema lacks is left to the model's family, once composed). `compose` composes the checked
overrides outside a Hydra app (the planner, trainer-run's check), `compose_job` into a JobConfig;
`job_config` makes one of a composed config."""

from __future__ import annotations

import copy
import dataclasses

from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from trainer.config.files import (
    BROKEN_RECIPES,
    CONFIG_DIR,
    RECIPE_DIR,
    register_configs,
    yaml_error,
)
from trainer.config.keys import group_keys, nearest_key, schema_keys, wanted
from trainer.config.schema import JobConfig, ModelConfig, OptimConfig
from trainer.errors import ConfigError, unknown_choice

GROUPS = ("recipe", "model", "parallel", "data", "optim", "smoke")
# Keys renamed, old spelling -> new: the old one still works for one release, with a notice.
RENAMED = {"checkpoint.async": "checkpoint.async_save"}


def renamed(argv: list[str]) -> tuple[list[str], list[str]]:
    """`argv` with the old spellings of renamed keys replaced, and a notice for each."""
    args, notices = [], []
    for arg in argv:
        sign = arg[:len(arg) - len(arg.lstrip("+~"))]
        key, eq, value = arg[len(sign):].partition("=")
        if key in RENAMED:
            notices.append(f"config: {key} is now {RENAMED[key]}; the old spelling goes in the "
                           "next release")
            arg = f"{sign}{RENAMED[key]}{eq}{value}"
        args.append(arg)
    return args, notices


def check_overrides(argv: list[str]) -> None:
    """Every `key=value` (or `+key=value`, `~key`) of `argv`: a known group choice or schema key."""
    keys = None
    for arg in argv:
        if arg.startswith("-") or ("=" not in arg and not arg.startswith("~")):
            continue  # Hydra's own flags (--cfg job) and their values
        key, _, name = arg.lstrip("+~").partition("=")
        if key in GROUPS:
            _check_choice(key, name)
        elif key.split(".")[0] != "hydra":
            keys = keys or schema_keys()
            _check_key(key, keys)


def compose_job(overrides: list[str]) -> JobConfig:
    """The job `train.py overrides...` would run, checked (see check_overrides) and composed: a file
    that does not parse, or a value of the wrong type, is a ConfigError."""
    return job_config(compose(overrides))


def compose(overrides: list[str]) -> DictConfig:
    """The config Hydra composes for `train.py overrides...` (see compose_job)."""
    import yaml
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from hydra.errors import HydraException

    register_configs()
    overrides, _ = renamed(overrides)
    check_overrides(overrides)
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            cfg = hydra_compose(config_name="config", overrides=overrides,
                                return_hydra_config=True)
        # As in the Hydra app: its choices name the run (${recipe_name:})
        HydraConfig.instance().set_config(cfg)
        with open_dict(cfg):
            del cfg["hydra"]
        job_config(cfg)  # every value of its type
        return cfg
    except yaml.YAMLError as e:
        raise yaml_error(e) from None
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(_composition_message(e)) from None


def command_line() -> list[str]:
    """The overrides the running Hydra app was given (none outside one)."""
    from hydra.core.hydra_config import HydraConfig

    try:
        return list(HydraConfig.get().overrides.task)
    except ValueError:  # not inside a Hydra app
        return []


def job_config(cfg: DictConfig) -> JobConfig:
    """The composed config `cfg` as a JobConfig, its model section an instance of its family's
    config class (trainer.models.model_config), its optim section of its optimizer's
    (trainer.optim.spec.optimizer_config); the modules of `imports` are imported first, as a family
    or optimizer defined outside trainer/ registers there."""
    from trainer.models import import_modules, model_config
    from trainer.optim.spec import optimizer_config

    import_modules(list(cfg.imports))
    model, optim = model_config(cfg.model), optimizer_config(cfg.optim)
    rest = copy.deepcopy(cfg)
    for section, cls in (("model", ModelConfig), ("optim", OptimConfig)):
        shared = {f.name for f in dataclasses.fields(cls)}
        for key in [k for k in rest[section] if k not in shared]:
            del rest[section][key]
    return dataclasses.replace(OmegaConf.to_object(rest), model=model, optim=optim)


def _composition_message(e: Exception) -> str:
    """A value of the wrong type: its key, the value and what the schema wants; else the first two
    lines of Hydra's message."""
    from omegaconf.errors import ValidationError

    cause = e
    while cause is not None and not isinstance(cause, ValidationError):
        cause = cause.__cause__ or cause.__context__
    if cause is not None and cause.full_key:
        group = group_keys(JobConfig, cause.full_key)
        if group:  # a group of keys given one value (metrics.tensorboard=true)
            said = f"{cause.full_key} is a group of keys ({', '.join(group)}), not a value"
            if "enabled" in group and isinstance(cause.value, bool):
                return f"{said}: did you mean {cause.full_key}.enabled={str(cause.value).lower()}?"
            return f"{said}: set one of them ({cause.full_key}.{group[0]}=...)"
        return f"{cause.full_key}={cause.value} must be {wanted(JobConfig, cause.full_key)}"
    return " ".join(str(e).split("\n")[:2]).strip()


def _check_choice(group: str, name: str) -> None:
    if group == "recipe" and name in BROKEN_RECIPES:
        raise BROKEN_RECIPES[name]
    folder = RECIPE_DIR if group == "recipe" else CONFIG_DIR / group
    known = sorted(p.stem for p in folder.glob("*.yaml"))
    if name not in known:
        raise unknown_choice(group, name, known)


def _check_key(key: str, keys: set[str]) -> None:
    # A key inside a list of mappings (data.mix[0].weight) is checked up to its list. A model key
    # the shared schema lacks is its family's to judge, an optim key its optimizer's, once the
    # config is composed (job_config).
    if key.split("[")[0] in keys or key.startswith(("model.", "optim.")):
        return
    near = nearest_key(key, keys)
    hint = f"; did you mean {near}?" if near else "; see `python train.py --cfg job` for every key"
    raise ConfigError(f"{key} is not a config key{hint}")
