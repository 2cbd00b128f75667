"""Diagnostics of models and checkpoints: max-norms, max attention logits, loss-landscape curvature."""
