"""Optimizers, each registered once as an OptimizerSpec (trainer/optim/spec.py) under the name
optim.name selects: AdamW and Muon here; one defined elsewhere registers in a module `imports`
names. Also the learning-rate schedule and gradient clipping."""

from trainer.optim import adamw, muon  # noqa: F401 (the built-in optimizers register)
