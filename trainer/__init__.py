"""A distributed trainer for Llama- and Mixtral-style models built around one DeviceMesh."""

from trainer.checkpoint import load_weights
from trainer.models import build_model

__all__ = ["build_model", "load_weights"]
