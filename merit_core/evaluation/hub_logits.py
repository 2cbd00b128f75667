"""The max attention logit of each revision of a hub model, for `merit eval ORG/NAME --revisions ...`.

A `merit train` run recorded its max logit at each step; a public training run did not, so it is
measured here by inspect's probe (the built-in paragraph, merit_core.diagnostics.inspect_report) on each
revision's snapshot in the hub cache: the value `merit inspect ORG/NAME@REV` reports.
"""

from __future__ import annotations

from merit_core.checkpoint.hub_revisions import HubModel, parse_hub_model
from merit_core.checkpoint.resolve import Taken, find_checkpoints
from merit_core.diagnostics.inspect_report import InspectOptions, inspect_checkpoint


def measured_max_logits(taken: Taken, device: str = "cpu") -> dict[int, float]:
    """step -> the max attention logit (max over layers) inspect's probe measures at each revision taken."""
    model = parse_hub_model(str(taken.run))
    if model is None:
        return {}
    opts = InspectOptions(updates=False, verify=False, device=device)
    out: dict[int, float] = {}
    for step, name in taken.picked:
        revision = parse_hub_model(str(name))
        (ckpt,) = find_checkpoints(str(HubModel(model.repo_id, revision.revision if revision else None)))
        peak = inspect_checkpoint(ckpt, opts).summary.max_attention_logit
        if peak is not None:
            out[step] = peak
    return out
