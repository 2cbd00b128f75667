"""Optimizers: MERIT, its ablations, and the baselines it is compared against."""
