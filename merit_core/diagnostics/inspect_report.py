"""`merit inspect` as a library call: checkpoints in, one typed report out.

    report = inspect_paths(["runs/adamw", "runs/merit/step_2000"], InspectOptions(hessian=True))
    report.checkpoints[0].layers[3].max_attention_logit
    write_json(report, "inspect.json")

`InspectReport.to_dict()` is the JSON shape (stable: fields are added, never renamed):
{"checkpoints": [{"path", "label", "step", "run", "architecture", "n_layers", "n_heads",
"n_kv_heads", "head_dim", "layers": [{"layer", "q_max_norm", "k_max_norm", "q_l2_norm",
"k_l2_norm", "bound", "max_attention_logit", attention entropy and activation fields, "heads": [...],
"q_rows", ...}], "weights": [...], "summary": {...}, "probe": {...} | null, "hessian": {...} | null,
"notes": [...], "output": {...} | null, "updates": {...} | null, "verdict": {...}}],
"inputs": [{"path", "kind": "run" | "checkpoint", "n_checkpoints", "verdict": {...} | null}]}.

A verdict (merit_core.diagnostics.verdict, docs/DIAGNOSTICS.md) is {"level": "healthy" | "watch" |
"alarming" | null, "history", "signals": [{"signal", "level", "value", "layer", "step", "rule",
"reason"}], "notes", and for a run "steps"}: each checkpoint's own, with the history rules of its
run when its input is a run folder; an input's is its run's (worst level per signal over its
checkpoints), null for a checkpoint given by itself.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from merit_core.checkpoint import runs
from merit_core.checkpoint.hub_revisions import HubRequest
from merit_core.checkpoint.resolve import ALL, Checkpoint, SafetensorsReader, Selection, find_checkpoints
from merit_core.checkpoint.state import optional_trainer_state
from merit_core.diagnostics.checkpoint_model import load_model
from merit_core.diagnostics.hessian import model_hessian
from merit_core.diagnostics.layout import read_config
from merit_core.diagnostics.logit_bounds import layers_bound_terms, logit_bounds, spectral_logit_bounds
from merit_core.diagnostics.probe_batch import ProbeInfo, make_probe_batch
from merit_core.diagnostics.streamed import WeightReads
from merit_core.diagnostics.update_size import UpdateReport, checkpoint_update_sizes
from merit_core.diagnostics.verdict import Verdict, checkpoint_verdict, run_verdict, trajectory_verdicts
from merit_core.diagnostics.weights import (
    LayerStats,
    WeightStats,
    attention_weight_stats,
    checkpoint_context,
    record_fields,
)
from merit_core.durable_writes import atomic_write_json
from merit_core.errors import DataError, MeritError
from merit_core.metric_names import (
    ACTIVATION_RATIO,
    LOG_Z_MAX,
    LOG_Z_MEAN,
    LOG_Z_STD,
    MAX_ATTENTION_LOGIT,
    NORMALIZED_ENTROPY_MIN,
    OUTPUT_LOGIT_MAX,
    UPDATE_RATIO,
)
from merit_core.metrics import count_non_finite, json_safe, read_metrics
from merit_core.models import context_length
from merit_core.models.attention_probe import ProbeResult, probe_attention
from merit_core.precursors import Precursors, is_number, peak
from merit_core.progress import Progress, ProgressFn, report_to

TRAINER_KEYS = ("optimizer", "global_batch_size", "seq_len", "tokens")
SUMMARY_KEYS = ("q_max_norm", "k_max_norm", "bound", MAX_ATTENTION_LOGIT, ACTIVATION_RATIO)
MIN_SUMMARY_KEYS = (NORMALIZED_ENTROPY_MIN,)  # where the smallest over layers is the alarming one


@dataclass
class InspectOptions:
    """What to compute besides the weight statistics, and how."""

    n_heads: int | None = None  # head count when there is no config.json
    top_k: int = 3  # outlier rows / columns named per matrix
    logits: bool = True  # build the model and measure max attention logits (needs config.json)
    text: str | None = None  # probe text; None = the built-in paragraph
    text_source: str = "builtin"  # 'builtin' | 'text' | 'file', recorded in the report
    seq_len: int | None = None  # most tokens measured; default: the context for a text, min(context, 256) builtin
    query_chunk: int = 128
    hessian: bool = False
    hessian_iters: int = 20
    hutchinson_samples: int = 10
    seed: int = 0
    device: str = "cpu"
    updates: bool = True  # update size from a `merit train` checkpoint's optimizer state
    selection: Selection = ALL  # which checkpoints of a run folder
    verify: bool = True  # check each checkpoint's files against the checksums it recorded
    hub: HubRequest | None = None  # a hub model's revisions, and how they are fetched


TRAINING_LOGIT_NOTE = "training recorded max attention logit"  # how training_logit_note's notes begin
TRAINING_LOGIT = "training_logit"  # the kind of those notes


class Note(str):
    """A note of a report that a reader tells apart by its `kind`: a str, so that the report's JSON
    keeps notes as plain text."""

    kind: str

    def __new__(cls, text: str, kind: str) -> Note:
        note = super().__new__(cls, text)
        note.kind = kind
        return note


@dataclass
class Summary:
    """Maxima over layers (and the layer holding each): what a trajectory or a comparison tracks."""

    q_max_norm: float | None = None
    q_max_norm_layer: int | None = None
    k_max_norm: float | None = None
    k_max_norm_layer: int | None = None
    bound: float | None = None  # the largest ||W_Q||_m * ||W_K||_m
    bound_layer: int | None = None
    max_attention_logit: float | None = None
    max_attention_logit_layer: int | None = None
    activation_ratio: float | None = None  # the largest max |h| / median |h| of the residual stream
    activation_ratio_layer: int | None = None
    normalized_attention_entropy_min: float | None = None  # the smallest, over layers and heads
    normalized_attention_entropy_min_layer: int | None = None
    log_z_mean: float | None = None  # the output layer's (one per checkpoint)
    update_rms_ratio: float | None = None  # the largest RMS(update) / RMS(weight) over 2-D weights
    update_rms_ratio_weight: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            **{k: getattr(self, k) for key in SUMMARY_KEYS + MIN_SUMMARY_KEYS for k in (key, f"{key}_layer")},
            LOG_Z_MEAN: self.log_z_mean,
            UPDATE_RATIO: self.update_rms_ratio,
            f"{UPDATE_RATIO}_weight": self.update_rms_ratio_weight,
        }


@dataclass
class CheckpointReport(WeightStats):
    """Everything `merit inspect` measured on one checkpoint: its weight statistics (WeightStats,
    with path, label and step set) plus the run it belongs to, its trainer state, the probe and
    the Hessian."""

    run: str | None = None
    trainer_state: dict[str, Any] = field(default_factory=dict)  # the TRAINER_KEYS its trainer_state.json has
    probe: ProbeInfo | None = None
    hessian: dict[str, Any] | None = None
    updates: UpdateReport | None = None  # update size from the checkpoint's optimizer state
    verdict: Verdict | None = None  # healthy / watch / alarming per signal (`judge`)
    # what the probe measured, with the logit bounds and the update ratio: the one record that the
    # layers and heads, the summary, the JSON and the verdict read
    precursors: Precursors = field(default_factory=Precursors)

    @property
    def optimizer(self) -> str | None:
        return self.trainer_state.get("optimizer")

    @property
    def summary(self) -> Summary:
        return summarize(self.layers, self.precursors)

    @property
    def output(self) -> dict[str, float] | None:
        """The output layer's max |logit| and log Z statistics."""
        o = self.precursors.output
        if o is None:
            return None
        return {
            OUTPUT_LOGIT_MAX: o.max_abs_logit,
            LOG_Z_MEAN: o.log_z_mean,
            LOG_Z_STD: o.log_z_std,
            LOG_Z_MAX: o.log_z_max,
        }

    @classmethod
    def from_weights(cls, ckpt: Checkpoint, stats: WeightStats, trainer_state: dict[str, Any]) -> CheckpointReport:
        weights = {f.name: getattr(stats, f.name) for f in dataclasses.fields(WeightStats)}
        return cls(
            **{
                **weights,
                "path": str(ckpt.path),
                "label": ckpt.label,
                "step": ckpt.step,
                "notes": ckpt.notes + stats.notes,
            },
            run=str(ckpt.run) if ckpt.run else None,
            trainer_state=trainer_state,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            **record_fields(self, "path", "label", "step", "run"),
            **{k: self.trainer_state[k] for k in TRAINER_KEYS if k in self.trainer_state},
            **self.body_dict(),
            "probe": self.probe.to_dict() if self.probe else None,
            "hessian": self.hessian,
            "summary": self.summary.to_dict(),
            "output": self.output,
            "updates": self.updates.to_dict() if self.updates else None,
            "verdict": self.verdict.to_dict() if self.verdict else None,
        }


@dataclass
class InputInfo:
    """One path given to inspect and what it resolved to."""

    path: str
    kind: str  # 'run' | 'checkpoint'
    n_checkpoints: int
    verdict: Verdict | None = None  # a run's, over its checkpoints; None for a checkpoint given by itself

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "kind": self.kind,
            "n_checkpoints": self.n_checkpoints,
            "verdict": self.verdict.to_dict() if self.verdict else None,
        }


@dataclass
class InspectReport:
    """The result of `inspect_paths`: the inputs and one report per checkpoint, in order."""

    inputs: list[InputInfo]
    checkpoints: list[CheckpointReport]

    def to_dict(self) -> dict[str, Any]:
        return {"inputs": [i.to_dict() for i in self.inputs], "checkpoints": [c.to_dict() for c in self.checkpoints]}


def _trainer_state(ckpt: Checkpoint) -> dict:
    state = optional_trainer_state(ckpt.folder, strict=False)
    named = {"tokens": ckpt.tokens} if ckpt.tokens is not None else {}  # a hub revision's name says
    if state is None:
        return named
    return {**named, **{k: state.get(k) for k in TRAINER_KEYS if state.get(k) is not None}}


def summarize(layers: list[LayerStats], p: Precursors) -> Summary:
    """Each summary key's alarming end over the layers with its layer (merit_core.precursors.peak:
    maxima, the minimum for entropy), the output layer's mean log Z and the largest update ratio:
    the numbers a trajectory or a side-by-side comparison tracks. The weights' keys are read from
    the layers, the probe's from the precursors record."""
    per_layer: dict[str, Any] = {
        MAX_ATTENTION_LOGIT: p.max_logit,
        ACTIVATION_RATIO: p.activation_ratio,
        NORMALIZED_ENTROPY_MIN: p.entropy_min,
    }
    found: dict[str, Any] = {}
    for key in SUMMARY_KEYS + MIN_SUMMARY_KEYS:
        values = per_layer[key] if key in per_layer else [getattr(layer, key) for layer in layers]
        top = peak(key, values)
        if top is not None:
            found[key], found[f"{key}_layer"] = top[0], layers[top[1]].layer
    return Summary(
        **found,
        log_z_mean=p.log_z_mean,
        update_rms_ratio=p.update_ratio,
        update_rms_ratio_weight=p.update_weight,
    )


def checkpoint_precursors(c: CheckpointReport, probed: ProbeResult | None) -> Precursors:
    """The checkpoint's one precursors record: the probe pass's (`ProbeResult.precursors`), its
    step, the largest update ratio and, per layer, the tighter of the two logit bounds."""
    bounds: list[float | None] = []
    kinds: list[str | None] = []
    for layer in c.layers:  # both bound the same logit: the smaller holds
        pairs = ((layer.spectral_logit_bound, "spectral"), (layer.logit_bound, "max-norm"))
        found = [(b, k) for b, k in pairs if is_number(b) and not math.isnan(b)]
        best = min(found) if found else (None, None)
        bounds.append(best[0])
        kinds.append(best[1])
    top = max(c.updates.weights, key=lambda w: w.ratio) if c.updates and c.updates.weights else None
    return dataclasses.replace(
        probed.precursors() if probed is not None else Precursors(),
        step=c.step,
        update_ratio=top.ratio if top else None,
        update_weight=top.name if top else None,
        logit_bound=bounds,
        bound_kind=kinds,
    )


def _measure(
    ckpt: Checkpoint,
    reader,
    config: dict,
    stats: CheckpointReport,
    opts: InspectOptions,
    progress: ProgressFn,
    layered: bool = False,
) -> ProbeResult | None:
    """Probe the model (the logit bounds, the Hessian and the update size go into `stats`), building
    it once from `config` (the checkpoint's config.json); returns the probe pass, if one ran.
    `layered`: the model holds one layer at a time (merit_core.models.layered_forward), and the
    weight table comes from the tensors the probe reads."""
    progress(Progress("building the model", item=ckpt.label))
    # the weight table, the layers' statistics and the bounds' weight terms, from the probe's read
    reads = WeightReads(reader, stats.layout, opts.top_k) if layered and stats.layout is not None else None
    model = load_model(ckpt, reader, opts.device, raw_config=config, layered=layered, tap=reads)
    # a user's text is measured as given, up to the context; the built-in paragraph fills 256 tokens
    seq_len = opts.seq_len or (
        context_length(model.config) if opts.text is not None else min(context_length(model.config), 256)
    )
    if seq_len > context_length(model.config):
        raise DataError(f"--seq-len {seq_len} exceeds the model's context of {context_length(model.config)}")
    batch = make_probe_batch(ckpt.folder, model.config.vocab_size, seq_len, opts.text, opts.text_source, opts.seed)
    ids = batch.input_ids.to(opts.device)
    stats.probe = batch.describe()
    probed = None
    if opts.logits:
        progress(Progress(f"max attention logits on {stats.probe.n_tokens} tokens", item=ckpt.label))
        probed = probe_attention(model, ids, query_chunk=opts.query_chunk, inputs=True, instability=True)
        if reads is not None:
            stats.weights, stats.layers = reads.weights(), reads.layer_stats()
        terms = reads.bound_terms() if reads is not None else layers_bound_terms(reader, stats.layout, stats.layers)
        if probed.input_max_l1 is not None:  # always measured with inputs=True
            logit_bounds(terms, stats.layers, probed.input_max_l1, probed.scaling)
        if probed.input_max_l2 is not None:
            stats.notes += spectral_logit_bounds(terms, stats.layers, probed.input_max_l2, probed.scaling)
    if opts.hessian:
        progress(
            Progress(
                f"Hessian ({opts.hessian_iters} Lanczos steps, {opts.hutchinson_samples} Hutchinson samples)",
                item=ckpt.label,
            )
        )
        est = model_hessian(model, ids, opts.hessian_iters, opts.hutchinson_samples, opts.seed)
        stats.hessian = {**est.to_dict(), "seq_len": stats.probe.n_tokens, "seed": opts.seed}
    if opts.updates:  # last: it steps the optimizer on the model's weights
        progress(Progress("update size from the optimizer state", item=ckpt.label))
        try:
            stats.updates = checkpoint_update_sizes(ckpt, model)
        except MeritError as exc:  # an optimizer whose package is missing, a state that does not fit
            stats.notes.append(f"update size not measured: {exc}")
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return probed


def inspect_checkpoint(
    ckpt: Checkpoint, opts: InspectOptions | None = None, progress: ProgressFn | None = None
) -> CheckpointReport:
    """Weight statistics, then (with a config.json) max attention logits and optionally the Hessian."""
    opts = opts or InspectOptions()
    progress = report_to(progress)
    with checkpoint_context(ckpt.path), ckpt.held():  # a hub revision may be fetched only now
        return _inspect_checkpoint(ckpt, opts, progress)


def probe_layered(ckpt: Checkpoint, config: dict | None, opts: InspectOptions) -> bool:
    """Whether the probe holds one layer at a time (the same numbers, a fraction of the memory): when
    the model serves only its forward pass, not the Hessian or the update size of optimizer state."""
    whole = opts.hessian or (opts.updates and (ckpt.folder / runs.STATE_PT).is_file())
    return config is not None and opts.logits and not whole


def _inspect_checkpoint(ckpt: Checkpoint, opts: InspectOptions, progress: ProgressFn) -> CheckpointReport:
    reader = SafetensorsReader(ckpt)
    progress(Progress("weight statistics", item=ckpt.label))
    config = read_config(ckpt.config_path)  # read once: the weight statistics and the model use it
    layered = probe_layered(ckpt, config, opts)
    # layered: the weight table and the layers' W_Q / W_K statistics come from the probe's read of them
    weights = attention_weight_stats(  # l2 norms from the Gram products the logit bounds take, when they are taken
        reader, config, opts.n_heads, opts.top_k, not layered, not layered, grams=opts.logits and config is not None
    )
    stats = CheckpointReport.from_weights(ckpt, weights, _trainer_state(ckpt))
    probed = None
    if opts.logits or opts.hessian:
        if config is None:  # no config.json next to the weights
            stats.notes.append(
                "no config.json next to the weights: max attention logit"
                + (" and Hessian" if opts.hessian else "")
                + " not measured"
            )
        else:
            probed = _measure(ckpt, reader, config, stats, opts, progress, layered)
    stats.precursors = checkpoint_precursors(stats, probed)
    if probed is not None:
        for layer in stats.layers:
            layer.attach(stats.precursors)
    note = training_logit_note(ckpt, stats)
    if note is not None:
        stats.notes.append(note)
    return stats


def training_logit_note(ckpt: Checkpoint, stats: CheckpointReport) -> Note | None:
    """For a step of a `merit train` run: the max logit training recorded at that step, when it differs
    from the probe's, with why (training measures its first validation batch, inspect the probe text)."""
    probed = stats.summary.max_attention_logit
    run = ckpt.run or ckpt.folder.parent
    if probed is None or ckpt.step is None or not runs.is_run(run):
        return None
    recorded = [
        r[MAX_ATTENTION_LOGIT]
        for r in read_metrics(run)
        if r.get("step") == ckpt.step and isinstance(r.get(MAX_ATTENTION_LOGIT), list)
    ]
    top = peak(MAX_ATTENTION_LOGIT, recorded[-1] if recorded else [])
    if top is None:
        return None
    trained, layer = top
    if math.isclose(trained, probed, rel_tol=1e-3):
        return None
    probe = stats.probe
    what = {"builtin": "the built-in paragraph", "random-ids": "seeded random token ids"}.get(
        probe.source if probe else "", "the given text"
    )
    return Note(
        f"{TRAINING_LOGIT_NOTE} {trained:.4g} (layer {layer}) at step {ckpt.step}, measured on "
        f"the run's first validation batch; this probe is {what} ({probe.n_tokens if probe else '?'} tokens), "
        f"other inputs, hence {probed:.4g} (layer {stats.summary.max_attention_logit_layer})",
        TRAINING_LOGIT,
    )


def inspect_paths(
    paths: Sequence[str | Path], opts: InspectOptions | None = None, progress: ProgressFn | None = None
) -> InspectReport:
    """Inspect every checkpoint the paths resolve to (all are validated before any work starts)."""
    opts = opts or InspectOptions()
    hub = opts.hub or HubRequest()
    hub = hub if hub.progress is not None else dataclasses.replace(hub, progress=progress)  # downloads' bars
    resolved = [(Path(p), find_checkpoints(p, opts.selection, opts.verify, hub)) for p in paths]
    inputs = [InputInfo(str(p), "run" if any(c.run for c in cks) else "checkpoint", len(cks)) for p, cks in resolved]
    checkpoints = [inspect_checkpoint(c, opts, progress) for _, cks in resolved for c in cks]
    report = InspectReport(inputs, checkpoints)
    judge(report)
    return report


def judge(report: InspectReport) -> None:
    """Set the verdicts: each checkpoint's (with its run's history when its input is a run folder)
    and each run input's over its checkpoints."""
    start = 0
    for given in report.inputs:  # the checkpoints of each input follow one another, in input order
        taken = report.checkpoints[start : start + given.n_checkpoints]
        start += given.n_checkpoints
        if given.kind == "run":
            verdicts = trajectory_verdicts([c.precursors for c in taken])
            for c, verdict in zip(taken, verdicts):
                c.verdict = verdict
            given.verdict = run_verdict(verdicts, [c.step for c in taken])
        else:
            for c in taken:
                c.verdict = checkpoint_verdict(c.precursors)


def write_json(report: InspectReport | dict, path: str | Path) -> int:
    """Write the report (its `to_dict()`) atomically and durably (merit_core.checkpoint.runs), with the user's umask.

    JSON has no NaN or Infinity: a value that is not finite (a weight that overflowed) is written
    as null (merit_core.metrics.json_safe). Returns how many were, for the caller to say so."""
    if hasattr(report, "to_dict"):
        report = report.to_dict()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    replaced = count_non_finite(report)
    atomic_write_json(path, json_safe(report) if replaced else report, indent=1, allow_nan=False)
    return replaced
