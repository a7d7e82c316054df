"""Optimizers (AdamW, Muon), the learning-rate schedule and gradient clipping."""
