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

**Extrapolation has limits.** The rule is supported only near its entries: the CPU grids bore it
out over one 8x step of tokens per step (batch 2 -> 16), and a x3 grid knows each best lr to a
factor of ~1.7. A request more than EXTRAPOLATION_LIMIT (4x) from its entry's tokens per step,
either way, or for a model without entries, is *extrapolated*: its lr is capped at the largest lr
any grid found stable (neither diverged nor unstable on any seed) for that optimizer and model, or the model
nearest in width (:data:`STABLE_LRS`, each naming its run), and the source says both. Why 4x:
entries 8x apart leave every point between them within sqrt(8) = 2.8x of one, so interpolation
never counts as extrapolation, while 4x already moves the lr by 2x, beyond which the
measured grids show MERIT poor at 3x its best lr and diverging at 9x.

The caller names the model and its width (d_model; None when its config cannot be read: then
only an entry of the same model name applies, else the caller falls back to the registry default
and says so); :func:`table_width` reads it for a name the tables know or a config.json, nothing
more (this package builds no model configs). The registry
(:mod:`merit_core.optim.registry`) attaches each table to its optimizer's spec; this module
holds the entries, the runs that measured them and the rule, nothing else.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path


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
    width: int | None = None  # the model's d_model, for the nearest-width rule (None: same-model lookups only)

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
    extrapolated: bool = False  # beyond EXTRAPOLATION_LIMIT of the entry, or another model (capped)
    cap: StableLr | None = None  # the stable lr that capped an extrapolated lr (None: no cap applied)


@dataclass(frozen=True)
class StableLr:
    """The largest lr a measured grid trained stably (neither diverged nor unstable), for one optimizer and model."""

    model: str
    lr: float
    run: str
    width: int | None = None


# How far (tokens per step, either way) the square-root rule may reach from its entry before the lr
# counts as extrapolated and is capped (module docstring).
EXTRAPOLATION_LIMIT = 4.0


# Measured lrs (read by lr_from_table; the losses behind each entry are in benchmarks/README.md,
# "Measured learning rates"). COMPARE_CPU: the best lr by mean final validation loss in x3 grids
# (results/compare-cpu/REPORT.md; the 2026-12-01 re-run, 3 seeds at each best lr, kept every entry). H200: GPT-2 small shape on the built-in corpus,
# 100 steps, one seed, four lrs for MERIT and two for AdamW: a first GPU data point, not a sweep.
# NANOGPT: AdamW's lr in the GPT-2 small recipe everyone starts from, at its batch.
COMPARE_CPU = "results/compare-cpu"
NANOGPT = "nanoGPT's GPT-2 (124M) recipe on OpenWebText, a published setting (not measured here)"
H200_FIRST = "an H200 sweep of 100 steps, one seed: a first GPU data point (benchmarks/README.md)"
TINY, SMALL = 128, 768  # d_model of gpt2-tiny and gpt2-small
MERIT_LRS = (
    MeasuredLr("gpt2-tiny", 2, 128, 1e-2, COMPARE_CPU, TINY),
    MeasuredLr("gpt2-tiny", 16, 128, 2.83e-2, COMPARE_CPU, TINY),
    MeasuredLr("gpt2-small", 64, 1024, 2e-3, H200_FIRST, SMALL),
)
ADAMW_LRS = (
    MeasuredLr("gpt2-tiny", 2, 128, 1e-3, COMPARE_CPU, TINY),
    MeasuredLr("gpt2-tiny", 16, 128, 2.83e-3, COMPARE_CPU, TINY),
    MeasuredLr("gpt2-small", 64, 1024, 6e-4, H200_FIRST, SMALL),
    MeasuredLr("gpt2-small", 480, 1024, 6e-4, NANOGPT, SMALL),
)
# LAMB was not run on the GPU: its GPT-2 small entry is MERIT's measured lr, named as such (the two
# trust-ratio optimizers had the same best lr at gpt2-tiny batch 16 in results/compare-cpu).
LAMB_LRS = (
    MeasuredLr("gpt2-tiny", 2, 128, 3e-2, COMPARE_CPU, TINY),
    MeasuredLr("gpt2-tiny", 16, 128, 2.83e-2, COMPARE_CPU, TINY),
    MeasuredLr("gpt2-small", 64, 1024, 2e-3, "MERIT's lr in " + H200_FIRST + "; LAMB itself not measured there", SMALL),
)
# The largest lr each optimizer's grids trained stably, per model (the cap of an extrapolated lr): neither
# diverged nor unstable (merit_core/compare/stability.py: a saturated attention logit, or a loss collapsed
# above the best lr) on any seed. gpt2-tiny: the grids of results/compare-cpu, where every larger lr was
# unstable (MERIT 0.03 at batch 2 and 0.0849 at 16, AdamW 0.003 and 0.00849, LAMB 0.09 and 0.0849);
# tests/compare/test_compare_stability.py derives these from its summary.json. H200: the GPT-2 small
# sweep above (finite losses; its logits were not recorded).
STABLE_LRS: dict[str, tuple[StableLr, ...]] = {
    "merit": (
        StableLr("gpt2-tiny", 2.83e-2, COMPARE_CPU, TINY),
        StableLr("gpt2-small", 2e-2, H200_FIRST, SMALL),
    ),
    "adamw": (
        StableLr("gpt2-tiny", 2.83e-3, COMPARE_CPU, TINY),
        StableLr("gpt2-small", 2e-3, H200_FIRST, SMALL),
    ),
    "lamb": (
        StableLr("gpt2-tiny", 3e-2, COMPARE_CPU, TINY),
        StableLr("gpt2-small", 2e-2, "MERIT's in " + H200_FIRST + "; LAMB itself not measured there", SMALL),
    ),
}


def table_width(model: str) -> int | None:
    """The width (d_model) of ``model``: its entries' in the tables (a name such as "gpt2-tiny"), else
    the ``n_embd`` / ``hidden_size`` of a config.json file or a folder holding one; None otherwise."""
    for entry in (*MERIT_LRS, *ADAMW_LRS, *LAMB_LRS):
        if entry.model == model and entry.width:
            return entry.width
    path = Path(model)
    path = path / "config.json" if path.is_dir() else path
    if path.suffix != ".json" or not path.is_file():
        return None
    try:
        with path.open("rb") as f:
            config = json.loads(f.read(1 << 20))  # a model config is a few kB: read a bounded prefix
    except (OSError, ValueError):
        return None
    width = config.get("n_embd") or config.get("hidden_size") if isinstance(config, dict) else None
    return width if isinstance(width, int) and not isinstance(width, bool) and width > 0 else None


def _nearest_model(items, model: str, width: int | None):
    """The items of `model`, else those of the model nearest `width` (None: no width, no match)."""
    same = [e for e in items if e.model == model]
    if same or width is None:
        return same
    widths = {e.model: e.width for e in items if e.width}
    if not widths:
        return []
    nearest = min(widths, key=lambda m: (_distance(width, widths[m]), -widths[m]))
    return [e for e in items if e.model == nearest]


def _distance(a: float, b: float) -> float:
    return abs(math.log(a / b))


def lr_from_table(
    table: tuple[MeasuredLr, ...],
    head: str,
    model: str,
    width: int | None,
    batch_size: int,
    seq_len: int,
    shared: str = "",
) -> LrDefault | None:
    """The lr ``table`` (optimizer ``head``'s) gives ``model`` (``width`` wide; None when unknown) at
    ``batch_size`` x ``seq_len`` by the rule in the module docstring, capped when extrapolated; None
    when neither ``model`` nor (without a width) a nearest-width model has an entry. ``shared`` is
    appended to the source (an ablation sharing ``head``'s table)."""
    tokens = batch_size * seq_len
    same = _nearest_model(table, model, width)
    if not same:
        return None
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
    ratio = tokens / entry.tokens_per_step
    if entry.model == model and 1 / EXTRAPOLATION_LIMIT <= ratio <= EXTRAPOLATION_LIMIT:
        return LrDefault(lr, source, entry, scaled=True)
    reach = (
        f"{ratio:.3g}x its entry's tokens per step, beyond the {EXTRAPOLATION_LIMIT:g}x the rule is checked for"
        if entry.model == model
        else f"no entry for {model}"
    )
    stable = _nearest_model(STABLE_LRS.get(head, ()), model, width)
    cap = stable[0] if stable else None
    if cap is not None and lr > cap.lr:
        source = (
            f"extrapolated ({reach}): {lr:g} capped at {cap.lr:g}, the largest lr {head}'s grids trained stably "
            f"on {cap.model} (run: {cap.run}); from {source}"
        )
        return LrDefault(cap.lr, source, entry, scaled=True, extrapolated=True, cap=cap)
    limit = f"; under the cap {cap.lr:g} ({cap.model}, run: {cap.run})" if cap is not None else "; no cap measured"
    return LrDefault(lr, f"extrapolated ({reach}){limit}: {source}", entry, scaled=True, extrapolated=True)
