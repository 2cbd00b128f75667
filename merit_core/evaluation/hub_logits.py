"""The max attention logit of each revision of a hub model, for `merit eval ORG/NAME --revisions ...`, and
the revisions scored one at a time when each one's weights are deleted once read (`--drop-weights`).

A `merit train` run recorded its max logit at each step; a public training run did not, so it is
measured here by inspect's probe (the built-in paragraph, merit_core.diagnostics.inspect_report) on each
revision's snapshot in the hub cache: the value `merit inspect ORG/NAME@REV` reports. It is measured on
the CPU (`PROBE_DEVICE`) whichever device scores, so that a revision's value does not depend on how it
was scored.

With `--drop-weights` a trajectory need not fit on disk: `score_one_at_a_time` fetches a revision
(merit_core.checkpoint.resolve, `Checkpoint.held`), checks it as eval checks every checkpoint, scores it,
measures its max logit, and deletes its weights from the hub cache before the next revision is fetched.
The results are those of the run that keeps every revision (the same files, read alike).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from merit_core.checkpoint.hub_revisions import HubModel, HubRequest, parse_hub_model
from merit_core.checkpoint.resolve import Checkpoint, Taken, find_checkpoints
from merit_core.diagnostics.inspect_report import InspectOptions, inspect_checkpoint
from merit_core.errors import CheckpointError
from merit_core.evaluation.checkpoint import CheckpointRef, check_causal_lm, check_tokenizer, resolve_checkpoint
from merit_core.evaluation.harness import EvalSettings, Scorer
from merit_core.evaluation.results import CheckpointResult
from merit_core.evaluation.workers import Missing, Outcome
from merit_core.progress import ProgressFn

PROBE_DEVICE = "cpu"  # where a revision's max logit is measured, whichever device scores it


def max_logit(ckpt: Checkpoint, device: str = PROBE_DEVICE) -> float | None:
    """The max attention logit (max over layers) inspect's probe measures on one checkpoint."""
    opts = InspectOptions(updates=False, verify=False, device=device)
    return inspect_checkpoint(ckpt, opts).summary.max_attention_logit


def measured_max_logits(taken: Taken, device: str = PROBE_DEVICE) -> dict[int, float]:
    """step -> the max attention logit (max over layers) inspect's probe measures at each revision taken."""
    model = parse_hub_model(str(taken.run))
    if model is None:
        return {}
    out: dict[int, float] = {}
    for step, name in taken.picked:
        revision = parse_hub_model(str(name))
        (ckpt,) = find_checkpoints(str(HubModel(model.repo_id, revision.revision if revision else None)))
        peak = max_logit(ckpt, device)
        if peak is not None:
            out[step] = peak
    return out


def score_one_at_a_time(
    names: Sequence[str],
    settings: EvalSettings,
    request: HubRequest,
    steps: Sequence[int] | None = None,
    progress: ProgressFn | None = None,
    quiet: bool = False,
    note: Callable[[str], None] | None = None,
) -> tuple[Outcome, dict[int, float]]:
    """Score the hub models `names` (ORG/NAME@REV) in order, one on disk at a time: each is fetched
    when its turn comes and its weights are deleted from the hub cache before the next is fetched.

    With `steps` (a trajectory: one step per name), each revision's max logit is measured while its
    weights are there; the second value maps step -> max logit. The tasks are loaded (and checked)
    once, before the first revision is fetched. A revision that cannot be fetched or read (offline,
    with its weights gone from the cache; a damaged file) is missing from the Outcome with one line
    saying why, and the others are scored; any other error stops the run."""
    settings = settings.validated()
    trust = settings.trust_remote_code
    request = replace(request, revisions=None, drop_weights=True, trust_remote_code=trust, progress=progress)
    scorer = Scorer(settings, [CheckpointRef(n, n, is_local=False) for n in names], progress, quiet, note)
    records: list[CheckpointResult] = []
    scored: list[int] = []
    missing: list[Missing] = []
    logits: dict[int, float] = {}
    notes: dict[str, list[str]] = {}
    for index, name in enumerate(names):
        try:
            (ckpt,) = find_checkpoints(name, verify=False, hub=request)  # nothing fetched yet
            with ckpt.held() as held:
                ref = resolve_checkpoint(name, trust, settings.verify, progress, snapshot=held.folder)
                check_causal_lm(ref, trust)
                check_tokenizer(ref, trust)
                scorer.run.refs[index] = ref
                record = scorer.score(index)
                peak = max_logit(held) if steps is not None else None
        except CheckpointError as exc:  # the line names the revision once
            missing.append(Missing(name, name, str(exc) if str(exc).startswith(name) else f"{name}: {exc}"))
            continue
        for text in ref.notes:
            notes.setdefault(text, []).append(ref.label)
        records.append(record)
        scored.append(index)
        if steps is not None and peak is not None:
            logits[steps[index]] = peak
    for text, who in sorted(notes.items()):  # said once for several, as the run that checks all first says it
        if note is not None:
            note(f"{who[0] if len(who) == 1 else f'{len(who)} checkpoints'}: {text}")
    return Outcome(records, scored, missing), logits
