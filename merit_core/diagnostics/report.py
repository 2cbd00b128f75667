"""`merit inspect` as a library call: checkpoints in, one JSON-ready report out.

    report = inspect_paths(["runs/adamw", "runs/merit/step_2000"], InspectOptions(hessian=True))
    write_json(report, "inspect.json")

Shape: {"checkpoints": [{"path", "label", "step", "run", "architecture", "n_layers", "n_heads",
"n_kv_heads", "head_dim", "layers": [{"layer", "q_max_norm", "k_max_norm", "q_l2_norm",
"k_l2_norm", "bound", "max_attention_logit", "heads": [...], "q_rows", ...}], "weights": [...],
"summary": {...}, "probe": {...} | null, "hessian": {...} | null, "notes": [...]}],
"inputs": [{"path", "kind": "run" | "checkpoint", "n_checkpoints"}]}.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from merit_core.diagnostics.checkpoints import Checkpoint, SafetensorsReader, find_checkpoints
from merit_core.diagnostics.weights import attention_weight_stats, checkpoint_context, read_config


@dataclass
class InspectOptions:
    """What to compute besides the weight statistics, and how."""

    n_heads: int | None = None  # head count when there is no config.json
    top_k: int = 3  # outlier rows / columns named per matrix
    logits: bool = True  # build the model and measure max attention logits (needs config.json)
    text: str | None = None  # probe text; None = the built-in paragraph
    text_source: str = "builtin"  # 'builtin' | 'text' | 'file', recorded in the report
    seq_len: int | None = None  # default min(context, 256)
    query_chunk: int = 128
    hessian: bool = False
    hessian_iters: int = 20
    hutchinson_samples: int = 10
    seed: int = 0
    device: str = "cpu"


def _trainer_state(ckpt: Checkpoint) -> dict:
    path = ckpt.folder / "trainer_state.json"
    if not path.is_file():
        return {}
    try:
        state = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return {}
    keys = ("optimizer", "global_batch_size", "seq_len", "tokens")
    return {k: state[k] for k in keys if isinstance(state, dict) and k in state}


def summarize(stats: dict) -> dict:
    """Maxima over layers: the numbers a trajectory or a side-by-side comparison tracks."""
    layers = stats["layers"]

    def top(key):
        vals = [(l[key], l["layer"]) for l in layers if l.get(key) is not None]
        return max(vals) if vals else (None, None)

    out = {}
    for key in ("q_max_norm", "k_max_norm", "bound", "max_attention_logit"):
        out[key], out[f"{key}_layer"] = top(key)
    return out


def _measure(ckpt: Checkpoint, reader, stats: dict, opts: InspectOptions, progress) -> None:
    """Fill max attention logits (and the Hessian) into `stats`, building the model once."""
    import torch

    from merit_core.diagnostics.attention import max_attention_logits
    from merit_core.diagnostics.probe import load_model, make_probe_batch
    from merit_core.models import context_length

    progress(f"{ckpt.label}: building the model")
    model = load_model(ckpt, reader, opts.device)
    seq_len = opts.seq_len or min(context_length(model.config), 256)
    if seq_len > context_length(model.config):
        from merit_core.errors import DataError

        raise DataError(f"--seq-len {seq_len} exceeds the model's context of {context_length(model.config)}")
    batch = make_probe_batch(ckpt.folder, model.config.vocab_size, seq_len, opts.text, opts.text_source, opts.seed)
    ids = batch.input_ids.to(opts.device)
    stats["probe"] = batch.describe()
    if opts.logits:
        progress(f"{ckpt.label}: max attention logits on {seq_len} tokens")
        logits = max_attention_logits(model, ids, query_chunk=opts.query_chunk)
        for layer, row in zip(stats["layers"], logits.tolist()):
            layer["max_attention_logit"] = max(row)
            if not layer["heads"]:
                layer["heads"] = [{"head": h} for h in range(len(row))]
            for head, value in zip(layer["heads"], row):
                head["max_attention_logit"] = value
    if opts.hessian:
        from merit_core.diagnostics.hessian import model_hessian

        progress(
            f"{ckpt.label}: Hessian ({opts.hessian_iters} power iterations, "
            f"{opts.hutchinson_samples} Hutchinson samples)"
        )
        est = model_hessian(model, ids, opts.hessian_iters, opts.hutchinson_samples, opts.seed)
        stats["hessian"] = {**est.to_dict(), "seq_len": seq_len, "seed": opts.seed}
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def inspect_checkpoint(
    ckpt: Checkpoint, opts: InspectOptions | None = None, progress: Callable[[str], None] | None = None
) -> dict:
    """Weight statistics, then (with a config.json) max attention logits and optionally the Hessian."""
    opts = opts or InspectOptions()
    progress = progress or (lambda msg: None)
    with checkpoint_context(ckpt.path):
        return _inspect_checkpoint(ckpt, opts, progress)


def _inspect_checkpoint(ckpt: Checkpoint, opts: InspectOptions, progress: Callable[[str], None]) -> dict:
    reader = SafetensorsReader(ckpt)
    progress(f"{ckpt.label}: weight statistics")
    stats = attention_weight_stats(reader, read_config(ckpt.config_path), opts.n_heads, opts.top_k)
    stats = {
        "path": str(ckpt.path),
        "label": ckpt.label,
        "step": ckpt.step,
        "run": str(ckpt.run) if ckpt.run else None,
        **_trainer_state(ckpt),
        **stats,
        "probe": None,
        "hessian": None,
    }
    stats["notes"] = ckpt.notes + stats["notes"]
    if opts.logits or opts.hessian:
        if ckpt.config_path is None:
            stats["notes"].append(
                "no config.json next to the weights: max attention logit"
                + (" and Hessian" if opts.hessian else "")
                + " not measured"
            )
        else:
            _measure(ckpt, reader, stats, opts, progress)
    stats["summary"] = summarize(stats)
    return stats


def inspect_paths(
    paths: Sequence[str | Path], opts: InspectOptions | None = None, progress: Callable[[str], None] | None = None
) -> dict:
    """Inspect every checkpoint the paths resolve to (all are validated before any work starts)."""
    resolved = [(Path(p), find_checkpoints(p)) for p in paths]
    inputs = [
        {"path": str(p), "kind": "run" if any(c.run for c in cks) else "checkpoint", "n_checkpoints": len(cks)}
        for p, cks in resolved
    ]
    checkpoints = [inspect_checkpoint(c, opts, progress) for _, cks in resolved for c in cks]
    return {"inputs": inputs, "checkpoints": checkpoints}


def write_json(report: dict, path: str | Path) -> None:
    """Write the report atomically and durably (merit_core.runs.atomic_write), with the user's umask."""
    from merit_core.runs import atomic_write_json

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, report, indent=1, allow_nan=True)
