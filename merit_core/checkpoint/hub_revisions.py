"""Hub model ids, their revisions, and which revisions `--revisions` picks (no network, no files).

A user names a hub model as `ORG/NAME` (its default revision, `main`) or `ORG/NAME@REV` (a branch, tag
or commit). `--revisions` picks several revisions of one repository, to read a public training run
as `merit inspect` reads a run folder:

- `A,B,C`: these revisions, in the order of their steps;
- `all`: every revision whose name carries a training step (`main` and other names without one are
  left out when some name has a step: they repeat a step already listed); every revision when none does;
- `FROM..TO`: the revisions whose steps lie between those of FROM and TO, both included; each side a
  revision name or a bare step number, either side may be left out (`step1000..`, `..5000`);
- any of these followed by `/K`: every K-th of the revisions picked, the last one always kept
  (`all/10`: a trajectory of about a tenth of the checkpoints, ending at the last).

A revision's name gives its step, and its tokens seen where the name says so (`revision_step`):
Pythia's `stepN` (2,097,152 tokens a step), OLMo's `stepN-tokensMB` and `stage1-stepN-tokensMB`
(M billion tokens), LLM360 Amber's `ckpt_NNN` (the checkpoint's number as its step).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from dataclasses import dataclass

from merit_core.errors import ConfigError
from merit_core.progress import ProgressFn

__all__ = [
    "DEFAULT_REVISION",
    "DROP_WEIGHTS_HELP",
    "PYTHIA_TOKENS_PER_STEP",
    "REVISIONS_HELP",
    "HubModel",
    "HubRequest",
    "RevisionChoice",
    "choose_revisions",
    "hub_request",
    "nearest_revisions",
    "parse_hub_model",
    "parse_revisions",
    "revision_step",
]

DEFAULT_REVISION = "main"
PYTHIA_TOKENS_PER_STEP = 2_097_152  # Pythia: 1,024 sequences of 2,048 tokens per step
REVISIONS_HELP = (
    "Revisions of a hub model ORG/NAME: A,B,... ; all ; FROM..TO (by step) ; each optionally /K for every "
    "K-th (e.g. all/10); see docs/DIAGNOSTICS.md."
)
DROP_WEIGHTS_HELP = (
    "Delete each hub revision's weights from the hub cache once it is read (config and tokenizer stay), "
    "before the next is fetched: the disk holds one revision's weights at a time."
)

# ORG/NAME[@REV]: the hub's own character set for both names; a revision may hold '/' (refs/pr/1)
_MODEL = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<rev>[\w.][\w./-]*))?")
_PYTHIA = re.compile(r"step(?P<step>\d+)")
_OLMO = re.compile(r"(?:.*-)?step(?P<step>\d+)-tokens(?P<tokens>\d+)(?P<unit>[KMBT])", re.IGNORECASE)
_AMBER = re.compile(r"ckpt_(?P<step>\d+)")
_NAME = re.compile(r"[\w.][\w./-]*")  # a branch, tag or commit name
_UNITS = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


@dataclass(frozen=True)
class HubModel:
    """A hub model as the user named it: the repository id and the revision (None: the default)."""

    repo_id: str
    revision: str | None = None

    def __str__(self) -> str:
        return self.repo_id if self.revision is None else f"{self.repo_id}@{self.revision}"


def parse_hub_model(text: str) -> HubModel | None:
    """`ORG/NAME` or `ORG/NAME@REV` -> a HubModel; None for anything else (a local path, a bare name)."""
    match = _MODEL.fullmatch(text.strip())
    if match is None or ".." in match.group("repo") or ".." in (match.group("rev") or ""):
        return None
    return HubModel(match.group("repo"), match.group("rev"))


def revision_step(name: str) -> tuple[int | None, int | None]:
    """(training step, tokens seen) a revision's name states; None for what it does not state."""
    if (m := _PYTHIA.fullmatch(name)) is not None:
        step = int(m.group("step"))
        return step, step * PYTHIA_TOKENS_PER_STEP
    if (m := _OLMO.fullmatch(name)) is not None:
        return int(m.group("step")), int(m.group("tokens")) * _UNITS[m.group("unit").upper()]
    if (m := _AMBER.fullmatch(name)) is not None:
        return int(m.group("step")), None
    return None, None


@dataclass(frozen=True)
class RevisionChoice:
    """What `--revisions` asked for (`parse_revisions`): kind 'list' (names), 'all' or 'range'
    (low / high: a revision name, a step number or None), then every `every`-th of them."""

    kind: str
    names: tuple[str, ...] = ()
    low: str | None = None
    high: str | None = None
    every: int = 1
    text: str = ""

    def __str__(self) -> str:
        return self.text or self.kind


@dataclass(frozen=True)
class HubRequest:
    """How a hub model is read: which revisions, whether code it ships may run, whether each
    revision's weights are deleted from the cache once read, and where download progress goes."""

    revisions: RevisionChoice | None = None
    trust_remote_code: bool = False
    drop_weights: bool = False
    progress: ProgressFn | None = None


def parse_revisions(text: str, option: str = "--revisions") -> RevisionChoice:
    """The text of `--revisions` -> a RevisionChoice; ConfigError in one line for what is not one."""
    body, every = text.strip(), 1
    if "/" in body and body.rsplit("/", 1)[1].strip().isdigit():
        body, k = body.rsplit("/", 1)
        every = int(k)
        if every < 1:
            raise ConfigError(f"{option} {text}: /K takes every K-th revision, K at least 1")
    body = body.strip()
    if not body:
        raise ConfigError(f"{option} is empty: give revision names, all, or FROM..TO (e.g. {option} all/10)")
    if body.lower() == "all":
        return RevisionChoice("all", every=every, text=text.strip())
    if ".." in body:
        low, high = (part.strip() or None for part in body.split("..", 1))
        odd = [side for side in (low, high) if side is not None and not _NAME.fullmatch(side)]
        if odd:
            raise ConfigError(f"{option} {text}: FROM..TO takes two revision names or step numbers, not {odd[0]!r}")
        return RevisionChoice("range", low=low, high=high, every=every, text=text.strip())
    names = tuple(dict.fromkeys(p.strip() for p in body.split(",") if p.strip()))
    bad = [n for n in names if not _NAME.fullmatch(n)]
    if bad or not names:
        raise ConfigError(f"{option} {text}: {bad[0] if bad else 'nothing'} is not a revision name")
    return RevisionChoice("list", names=names, every=every, text=text.strip())


def _order(name: str) -> tuple[int, int, int, str]:
    step, tokens = revision_step(name)
    return (0 if step is not None else 1, step or 0, tokens or 0, name)


def nearest_revisions(wanted: str, available: Sequence[str], limit: int = 6) -> list[str]:
    """The available revisions nearest `wanted`: by step when both name one, else by spelling."""
    step, _ = revision_step(wanted)
    stepped = [(revision_step(n)[0], n) for n in available]
    if step is not None and any(s is not None for s, _ in stepped):
        ranked = sorted((abs(s - step), s, n) for s, n in stepped if s is not None)
        return [n for _, _, n in ranked[:limit]]
    close = difflib.get_close_matches(wanted, list(available), n=limit, cutoff=0.0)
    return close


def _missing(repo: str, wanted: str, available: Sequence[str], option: str) -> ConfigError:
    near = nearest_revisions(wanted, available)
    more = f" (of {len(available)})" if len(available) > len(near) else ""
    has = f"; nearest it has{more}: {', '.join(near)}" if near else "; it lists no revisions"
    return ConfigError(f"{option}: {repo} has no revision {wanted!r}{has}")


def _bound(repo: str, side: str | None, available: Sequence[str], option: str) -> int | None:
    if side is None:
        return None
    if side.isascii() and side.isdigit():
        return int(side)
    if side not in available:
        raise _missing(repo, side, available, option)
    step, _ = revision_step(side)
    if step is None:
        raise ConfigError(f"{option}: revision {side!r} of {repo} names no step, so it cannot bound a range")
    return step


def choose_revisions(
    repo: str, available: Sequence[str], choice: RevisionChoice, option: str = "--revisions"
) -> list[str]:
    """The revisions of `repo` that `choice` picks among `available`, in step order (names without a
    step last, by name); ConfigError naming the nearest existing ones for a revision `repo` lacks."""
    ordered = sorted(set(available), key=_order)
    if choice.kind == "list":
        for name in choice.names:
            if name not in ordered and not re.fullmatch(r"[0-9a-f]{40}", name):
                raise _missing(repo, name, ordered, option)
        picked = sorted(choice.names, key=_order)
    elif choice.kind == "all":
        stepped = [n for n in ordered if revision_step(n)[0] is not None]
        picked = stepped or ordered
    else:
        low = _bound(repo, choice.low, ordered, option)
        high = _bound(repo, choice.high, ordered, option)
        picked = [
            n
            for n in ordered
            if (s := revision_step(n)[0]) is not None and (low is None or s >= low) and (high is None or s <= high)
        ]
    if not picked:
        raise ConfigError(f"{option} {choice}: no revision of {repo} matches (it has {len(ordered)})")
    if choice.every > 1:
        kept = picked[:: choice.every]
        if kept[-1] != picked[-1]:
            kept.append(picked[-1])
        picked = kept
    return picked


def hub_request(revisions: str | None, drop_weights: bool = False, trust_remote_code: bool = False) -> HubRequest:
    """The HubRequest of a command's --revisions, --drop-weights and --trust-remote-code."""
    choice = parse_revisions(revisions) if revisions is not None else None
    return HubRequest(choice, trust_remote_code=trust_remote_code, drop_weights=drop_weights)
