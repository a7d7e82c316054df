"""Plain computations the trainer's are held to."""

import torch
import torch.nn.functional as F


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy of whole logits: the reference the chunked loss (LMHead) is held
    to."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
