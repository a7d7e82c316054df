"""A rerun into an output_dir whose checkpoints it would resume must train what they trained: the
keys that shape the training (the model, the data, the optimizer, the batch, lr, seed, precision)
are held against the config.yaml saved beside them. Steps, layout, logging and checkpointing may
change."""

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
                 "training.max_norm", "training.seed", "training.mixed_precision.")


def check_rerun(config: dict, checkpoint: CheckpointConfig, output_dir: str) -> str | None:
    """A config error when this job would resume output_dir's checkpoints with other training
    settings than config.yaml says they were trained with (unless
    checkpoint.allow_config_change=true). Returns a line to say when it resumes them with another
    number of steps: the schedule changes."""
    saved_file = Path(output_dir) / "config.yaml"
    if not (checkpoint.enabled and checkpoint.resume == "auto"):
        return None
    steps = [step for step, path in checkpoint_steps(Path(output_dir) / "checkpoints")
             if (path / MANIFEST).is_file()]
    if not saved_file.is_file() or not steps:
        return None
    (saved, saved_model), (now, model) = (_read(OmegaConf.to_container(OmegaConf.load(saved_file))),
                                          _read(config))
    # A key a config lacks has its default: one added since config.yaml was written had it then.
    defaults = _flat(OmegaConf.to_container(OmegaConf.structured(JobConfig)))
    saved, now = {**defaults, **saved}, {**defaults, **now}
    changed = [f"{key}={saved.get(key)} -> {now.get(key)}"
               for key in sorted(saved.keys() | now.keys())
               if key.startswith(TRAINING_KEYS) and saved.get(key) != now.get(key)]
    # The model's shape: checkpoints of another cannot be loaded, whatever the flags say.
    shape = tuple(f"model.{name}=" for cfg in (saved_model, model) if cfg is not None
                  for name in shape_keys(cfg))
    if any(key.startswith(shape) for key in changed):  # not resumable at all: no flag offered
        raise ConfigError(f"output_dir={output_dir} holds checkpoints of another model "
                          f"({', '.join(c for c in changed if c.startswith(shape))}), which cannot "
                          "be resumed with this one; choose another output_dir "
                          "(checkpoint.initial=... takes weights of the same shape only)")
    change = state_change(saved, now)
    if change is not None:
        raise ConfigError(f"output_dir={output_dir} holds checkpoints {change}; choose another "
                          "output_dir and start from their weights with checkpoint.initial="
                          f"{Path(output_dir) / 'checkpoints' / f'step_{steps[-1]}'}")
    if changed and not checkpoint.allow_config_change:
        raise ConfigError(f"output_dir={output_dir} holds checkpoints trained with other settings "
                          f"({', '.join(changed[:8])}); choose another output_dir, or set "
                          f"checkpoint.allow_config_change=true to resume them with these")
    return _schedule_change(saved, now, steps[-1])


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
