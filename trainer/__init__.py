"""A distributed trainer for decoder language models (Llama, Mixtral, Qwen3, Qwen3-MoE, DeepSeek-V3)
built around one DeviceMesh. Its rooms and what each may import: trainer/README.md."""

from trainer.checkpoint import load_weights
from trainer.models import build_model

__all__ = ["build_model", "load_weights"]
