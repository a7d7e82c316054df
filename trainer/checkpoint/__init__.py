"""Checkpoints: DCP save/resume in any layout (state.py), the on-disk format (folders.py), saving
during training and restoring at start (saver.py), and Hugging Face interop (hf.py)."""

from trainer.checkpoint.folders import CheckpointError, verify
from trainer.checkpoint.metadata import SafeReader
from trainer.checkpoint.saver import Checkpointer, restore, roll_back
from trainer.checkpoint.state import TrainState, load_weights, save_weights

__all__ = ["CheckpointError", "Checkpointer", "SafeReader", "TrainState", "load_weights", "restore",
           "roll_back", "save_weights", "verify"]
