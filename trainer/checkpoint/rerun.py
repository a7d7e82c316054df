"""A rerun resumes only a checkpoint trained with its settings: the keys that shape the training
(the model and its adapters, the data, the optimizer, the batch, lr, seed, precision) are held
against the config saved inside the checkpoint itself (what the output_dir's config.yaml says now
does not count).
Steps, layout, logging and checkpointing may change."""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from trainer.checkpoint.folders import MANIFEST, checkpoint_steps
from trainer.config.schema import CheckpointConfig, JobConfig, ModelConfig, shape_keys
from trainer.errors import ConfigError
from trainer.models import model_config
from trainer.optim.schedule import lr_lambda
from trainer.optim.spec import optimizer_config, state_change

TRAINING_KEYS = ("model.", "data.", "optim.", "training.seq_len", "training.global_batch_size",
                 "training.lr", "training.warmup_steps", "training.weight_decay",
                 "training.max_norm", "training.seed", "training.mixed_precision.", "peft.")
# The adapters' shapes (or their presence): a checkpoint trained with others cannot be loaded.
ADAPTER_SHAPE = ("peft.method=", "peft.rank=", "peft.target_modules=")
# In each checkpoint: the composed config of the run that saved it.
TRAINED_CONFIG = "config.yaml"


def check_rerun(config: dict, checkpoint: CheckpointConfig, output_dir: str) -> str | None:
    """Before launch: a config error when this job would resume output_dir's newest checkpoint
    with other training settings than it was trained with (unless checkpoint.allow_config_change=
    true). Returns a line to say when it resumes it with another number of steps: the schedule
    changes."""
    if not (checkpoint.enabled and checkpoint.resume == "auto"):
        return None
    published = [path for _, path in checkpoint_steps(Path(output_dir) / "checkpoints")
                 if (path / MANIFEST).is_file()]
    if not published:
        return None
    try:
        trained_with(published[-1])
    except ConfigError:  # damaged: resume=auto skips it, and the ranks check the one they resume
        return None
    return check_settings(config, checkpoint, published[-1])


def trained_with(path: Path) -> dict | None:
    """The config checkpoint `path` was trained with: its own, or (saved by a version of this
    trainer that kept none in it) its run's config.yaml (OUTPUT_DIR's, for
    OUTPUT_DIR/checkpoints/step_N); None if neither is there."""
    run_config = path.parent.parent / "config.yaml" if path.parent.name == "checkpoints" else None
    for file in filter(None, (path / TRAINED_CONFIG, run_config)):
        if file.is_file():
            try:
                return OmegaConf.to_container(OmegaConf.load(file))
            except Exception as e:  # noqa: BLE001 (a damaged or foreign YAML: one line)
                raise ConfigError(f"{file} is not a config this trainer wrote: {e}") from None
    return None


def check_settings(config: dict, checkpoint: CheckpointConfig, path: Path) -> str | None:
    """A config error when checkpoint `path` was trained with other training settings than
    `config`'s; else the line on a changed schedule, if any."""
    trained = trained_with(path)
    if trained is None:
        return None
    (saved, saved_model), (now, model) = _read(trained), _read(config)
    # A key a config lacks has its default: one added since the checkpoint was saved had it then.
    defaults = _flat(OmegaConf.to_container(OmegaConf.structured(JobConfig)))
    saved, now = {**defaults, **saved}, {**defaults, **now}
    changed = [f"{key}={saved.get(key)} -> {now.get(key)}"
               for key in sorted(saved.keys() | now.keys())
               if key.startswith(TRAINING_KEYS) and saved.get(key) != now.get(key)]
    # The model's shape: checkpoints of another cannot be loaded, whatever the flags say.
    shape = (*(f"model.{name}=" for cfg in (saved_model, model) if cfg is not None
               for name in shape_keys(cfg)), *ADAPTER_SHAPE)
    where = f"output_dir={path.parent.parent}"
    if any(key.startswith(shape) for key in changed):  # not resumable at all: no flag offered
        raise ConfigError(f"{where} holds checkpoints of another model "
                          f"({', '.join(c for c in changed if c.startswith(shape))}), which cannot "
                          "be resumed with this one; choose another output_dir "
                          "(checkpoint.initial=... takes weights of the same shape only)")
    change = state_change(saved, now)
    if change is not None:
        raise ConfigError(f"{where} holds checkpoints {change}; choose another output_dir and "
                          f"start from their weights with checkpoint.initial={path}")
    if changed and not checkpoint.allow_config_change:
        raise ConfigError(f"{where} holds checkpoints trained with other settings "
                          f"({', '.join(changed[:8])}); choose another output_dir, or set "
                          "checkpoint.allow_config_change=true to resume them with these")
    step = path.name.partition("_")[2]
    return _schedule_change(saved, now, int(step)) if step.isdigit() else None


def _schedule_change(saved: dict, now: dict, step: int) -> str | None:
    """What a new training.steps does to the learning rate of the step after `step`, if it
    changes."""
    before, after = saved.get("training.steps"), now.get("training.steps")
    if before == after or not all(isinstance(v, int) for v in (before, after)):
        return None
    lr, warmup, floor = (now.get("training.lr"), now.get("training.warmup_steps"),
                         now.get("optim.min_lr_ratio"))
    if not all(isinstance(v, (int, float)) for v in (lr, warmup, floor)):
        return None
    old, new = (lr * lr_lambda(warmup, total, floor)(step) for total in (before, after))
    return (f"schedule: training.steps {before} -> {after} re-plans the cosine decay to end at "
            f"step {after}: the learning rate after the newest checkpoint (step {step}) goes from "
            f"{old:.3g} (as planned) to {new:.3g}")


def _read(config: dict) -> tuple[dict, ModelConfig | None]:
    """A config flattened (see _flat) with its model and optim sections whole, as this version reads
    them (a config.yaml of an earlier one holds keys no family or optimizer declares now); and its
    model."""
    if "optim" in config:
        try:
            optim = optimizer_config(OmegaConf.create(config["optim"]))
            config = {**config, "optim": OmegaConf.to_container(OmegaConf.structured(optim))}
        except ConfigError:  # an optimizer this run does not know: the optimizer's change says so
            pass
    if "model" not in config:
        return _flat(config), None
    model = model_config(config["model"])
    return _flat({**config, "model": OmegaConf.to_container(OmegaConf.structured(model))}), model


def _flat(node, prefix: str = "") -> dict:
    if not isinstance(node, dict):
        return {prefix[:-1]: node}
    return {key: value for name, child in node.items()
            for key, value in _flat(child, f"{prefix}{name}.").items()}
