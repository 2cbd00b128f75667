"""Measured learning rates: the tables of AdamW, LAMB and MERIT, and the rule that reads them.

No single lr serves every model size and batch, so AdamW, LAMB and MERIT carry a table of
*measured* lrs (:class:`MeasuredLr`: the best lr of a grid at one model, batch and sequence
length, each naming the run that measured it). The registry's ``default_lr`` reads them for
`merit train` when no lr is given, and for the centre of `merit compare`'s automatic grid:

- an entry for the same model and tokens per step: its lr;
- else the entry of the same model nearest in tokens per step (log scale), or, for a model
  without entries, the nearest entry of the measured model nearest in width (d_model), scaled
  by sqrt(tokens per step / the entry's tokens per step) (the square-root rule of Adam-type
  and trust-ratio optimizers; no width scaling: the measured models disagree on one);
- an optimizer without a table (Lion, Sophia-G, Muon) gets its `lr` default; MERIT's ablations
  share MERIT's table.

The registry (:mod:`merit_core.optim.registry`) attaches each table to its optimizer's spec;
this module holds the entries, the runs that measured them and the rule, nothing else.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class MeasuredLr:
    """The best lr of a measured lr grid for one model, global batch (sequences) and sequence length.

    run: what measured it, so a user can look it up: a committed `merit compare` output (a folder
    under results/) or a named measurement (see benchmarks/README.md, "Measured learning rates").
    """

    model: str
    batch_size: int
    seq_len: int
    lr: float
    run: str

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len


@dataclass(frozen=True)
class LrDefault:
    """An lr chosen for a run without one, and where it came from (one line for the start line)."""

    lr: float
    source: str
    entry: MeasuredLr | None = None  # the measured entry it comes from (None: the registry default)
    scaled: bool = False  # True when the entry was scaled to another batch, sequence length or model


# Measured lrs (read by lr_from_table; the losses behind each entry are in benchmarks/README.md,
# "Measured learning rates"). COMPARE_CPU: the best lr by mean final validation loss over 2 seeds
# in x3 grids (results/compare-cpu/REPORT.md). H200: GPT-2 small shape on the built-in corpus,
# 100 steps, one seed, four lrs for MERIT and two for AdamW: a first GPU data point, not a sweep.
# NANOGPT: AdamW's lr in the GPT-2 small recipe everyone starts from, at its batch.
COMPARE_CPU = "results/compare-cpu"
NANOGPT = "nanoGPT's GPT-2 (124M) recipe on OpenWebText, a published setting (not measured here)"
H200_FIRST = "an H200 sweep of 100 steps, one seed: a first GPU data point (benchmarks/README.md)"
MERIT_LRS = (
    MeasuredLr("gpt2-tiny", 2, 128, 1e-2, COMPARE_CPU),
    MeasuredLr("gpt2-tiny", 16, 128, 2.83e-2, COMPARE_CPU),
    MeasuredLr("gpt2-small", 64, 1024, 2e-3, H200_FIRST),
)
ADAMW_LRS = (
    MeasuredLr("gpt2-tiny", 2, 128, 1e-3, COMPARE_CPU),
    MeasuredLr("gpt2-tiny", 16, 128, 2.83e-3, COMPARE_CPU),
    MeasuredLr("gpt2-small", 64, 1024, 6e-4, H200_FIRST),
    MeasuredLr("gpt2-small", 480, 1024, 6e-4, NANOGPT),
)
# LAMB was not run on the GPU: its GPT-2 small entry is MERIT's measured lr, named as such (the two
# trust-ratio optimizers had the same best lr at gpt2-tiny batch 16 in results/compare-cpu).
LAMB_LRS = (
    MeasuredLr("gpt2-tiny", 2, 128, 3e-2, COMPARE_CPU),
    MeasuredLr("gpt2-tiny", 16, 128, 2.83e-2, COMPARE_CPU),
    MeasuredLr("gpt2-small", 64, 1024, 2e-3, "MERIT's lr in " + H200_FIRST + "; LAMB itself not measured there"),
)


def _width(model: str) -> int | None:
    """d_model of a named model or config.json, or None when it cannot be read."""
    from merit_core.errors import MeritError
    from merit_core.models import NAMED_MODELS, model_config

    if model in NAMED_MODELS:
        return NAMED_MODELS[model].d_model
    try:
        config = model_config(model)
    except (MeritError, OSError, ValueError):
        return None
    width = getattr(config, "n_embd", None) or getattr(config, "hidden_size", None)
    return int(width) if width else None


def _distance(a: float, b: float) -> float:
    return abs(math.log(a / b))


def lr_from_table(
    table: tuple[MeasuredLr, ...], head: str, model: str, batch_size: int, seq_len: int, shared: str = ""
) -> LrDefault | None:
    """The lr ``table`` (optimizer ``head``'s) gives ``model`` at ``batch_size`` x ``seq_len`` by the
    rule in the module docstring; None when ``model``'s width cannot be read and the table has no
    entry for it. ``shared`` is appended to the source (an ablation sharing ``head``'s table)."""
    tokens = batch_size * seq_len
    same = [e for e in table if e.model == model]
    if not same:
        width = _width(model)
        if width is None:
            return None
        widths = {e.model: _width(e.model) for e in table}
        nearest = min((m for m in widths if widths[m]), key=lambda m: (_distance(width, widths[m]), -widths[m]))
        same = [e for e in table if e.model == nearest]
    entry = min(same, key=lambda e: (_distance(tokens, e.tokens_per_step), -e.tokens_per_step))
    where = f"{head}'s measured lr for {entry.model} at batch {entry.batch_size} x {entry.seq_len}"
    if entry.model == model and entry.tokens_per_step == tokens:
        source = f"{head}'s measured default for {model} at batch {batch_size} x {seq_len}{shared}; run: {entry.run}"
        return LrDefault(entry.lr, source, entry, scaled=False)
    lr = float(f"{entry.lr * math.sqrt(tokens / entry.tokens_per_step):.3g}")
    other = "" if entry.model == model else f"; no measurement for {model}, nearest measured width"
    source = (
        f"{where}, {entry.lr:g}, x sqrt({tokens:,} / {entry.tokens_per_step:,} tokens per step){other}{shared}; "
        f"run: {entry.run}"
    )
    return LrDefault(lr, source, entry, scaled=True)
