"""The one resolver of a user's path to checkpoints, and the checkpoints inspect reads.

A run folder's steps are chosen by a `Selection` (`latest`, `all`, or chosen steps: what
`--steps latest|all|N,M` of inspect and eval parse, what resume and compare ask for) through
`select_steps`, at the level the caller needs (see merit_core.checkpoint.runs: weights, model,
complete). `took` says in one line which it took; `take` returns both at once (`Taken`), so that a
command says which checkpoints it took from the same resolution it works on.

For inspect a user path resolves to one or more `Checkpoint`s (`find_checkpoints`):
- a `*.safetensors` file;
- a sharded checkpoint's `model.safetensors.index.json`;
- a Hugging Face folder (`model.safetensors` or the sharded index, `config.json` alongside);
- a `merit train` run folder: its selected `step_<N>/` subfolders with weights, in step order
  (temporary `.tmp*` folders and folders without weights are skipped);
- a hub model `ORG/NAME` or `ORG/NAME@REV` that is not a local path, or several of its revisions
  (`HubRequest.revisions`, in step order, read as a run): each revision's snapshot folder in the hub
  cache, downloaded first where needed (merit_core.checkpoint.hub_cache).
Each is verified against the checksums its trainer_state.json records unless told not to.

Every weight file's header is checked against the file size before safetensors opens it, so a
truncated or corrupt file gets a precise one-line `CheckpointError`. Pickle-based checkpoints
(`.bin`, `.pt`, ...) are refused on their name or magic bytes; they are never read further.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from merit_core.checkpoint import runs
from merit_core.checkpoint.hub_cache import check_config_size, drop_weights, fetch_snapshot, list_revisions
from merit_core.checkpoint.hub_revisions import HubModel, HubRequest, choose_revisions, parse_hub_model, revision_step
from merit_core.checkpoint.runs import INDEX_NAME, WEIGHTS_NAME
from merit_core.checkpoint.safe import (  # the one safe reader of a checkpoint, shared with eval and resume
    PICKLE_SUFFIXES,
    index_files,
    open_regular,
    opened_path,
    refuse_pickle,
    refuse_special_files,
    validate_safetensors,
)
from merit_core.checkpoint.state import SKIPPED, optional_trainer_state, verify_checkpoint
from merit_core.errors import CheckpointError, ConfigError
from merit_core.file_reading import display

__all__ = [
    "ALL",
    "LATEST",
    "PICKLE_SUFFIXES",
    "STEPS_HELP",
    "Checkpoint",
    "Selection",
    "Taken",
    "latest_checkpoint",
    "parse_selection",
    "select_steps",
    "take",
    "took",
    "SafetensorsReader",
    "find_checkpoints",
    "hub_checkpoints",
    "take_revisions",
    "index_files",
    "open_regular",
    "refuse_pickle",
    "refuse_special_files",
    "validate_safetensors",
]


STEPS_HELP = "Which step_N checkpoints of a run folder: latest, all, or chosen steps (e.g. 100,200)."


@dataclass(frozen=True)
class Selection:
    """Which checkpoints of a run folder: the latest, all of them, or the chosen `steps`."""

    kind: str  # 'latest' | 'all' | 'steps'
    steps: tuple[int, ...] = ()

    def __str__(self) -> str:
        return ",".join(map(str, self.steps)) if self.kind == "steps" else self.kind


LATEST = Selection("latest")
ALL = Selection("all")


def parse_selection(text: str, option: str = "--steps") -> Selection:
    """'latest', 'all' or '100,200' (sorted, unique; ASCII digits only) -> a Selection; ConfigError else."""
    word = text.strip().lower()
    if word in ("latest", "all"):
        return Selection(word)
    steps = set()
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if not (part.isascii() and part.isdigit()):
            raise ConfigError(
                f"{option} {text}: give latest, all or step numbers separated by commas, e.g. {option} 100,200"
            )
        steps.add(int(part))
    if not steps:
        raise ConfigError(f"{option} is empty: give latest, all or step numbers, e.g. {option} 100,200")
    return Selection("steps", tuple(sorted(steps)))


def select_steps(
    run_dir: str | Path, selection: Selection, level: str = "model", option: str = "--steps"
) -> list[tuple[int, Path]]:
    """The (step, folder) checkpoints of a run folder at `level` that `selection` picks, oldest first.

    CheckpointError when the run has none; ConfigError naming the steps it has when a chosen step
    is not among them."""
    run_dir = Path(run_dir)
    found = runs.checkpoints(run_dir, level)
    if not found:
        raise CheckpointError(f"{display(run_dir)} has no step_N/ checkpoint{_LEVEL_WORDS[level]}")
    if selection.kind == "latest":
        return found[-1:]
    if selection.kind == "all":
        return found
    have = dict(found)
    missing = [s for s in selection.steps if s not in have]
    if missing:
        raise ConfigError(
            f"{option} {selection}: {display(run_dir)} has no checkpoint at step {', '.join(map(str, missing))}; "
            f"it has {_names(found)}"
        )
    return [(s, have[s]) for s in selection.steps]


def latest_checkpoint(run_dir: str | Path, level: str = "complete") -> tuple[int, Path] | None:
    """The (step, folder) that LATEST picks among a run folder's checkpoints at `level`, or None
    while it has none (a run that has not saved one yet: a comparison's run to train, or to resume)."""
    found = runs.checkpoints(run_dir, level)
    return found[-1] if found else None


_LEVEL_WORDS = {"weights": " with weights", "model": " with a model", "complete": " that is complete"}


def _names(found: list[tuple[int, Path]]) -> str:
    names = [p.name for _, p in found]
    return ", ".join(names if len(names) <= 8 else [*names[:3], "...", *names[-4:]])


def took(run_dir: str | Path, picked: list[tuple[int, Path]], selection: Selection) -> str:
    """One line saying which checkpoints of a run folder (or revisions of a hub model) a command took, and why."""
    if not Path(run_dir).exists() and parse_hub_model(str(run_dir)) is not None:
        return f"{display(run_dir)}: took {_names(picked)} (--revisions)"
    return f"{display(run_dir)}: took {_names(picked)} (--checkpoints {selection})"


@dataclass(frozen=True)
class Taken:
    """The checkpoints of one run folder that a Selection picked (`take`): what a command works on
    and what it says it took (`line`), from the one resolution."""

    run: Path
    selection: Selection
    picked: tuple[tuple[int, Path], ...]

    @property
    def steps(self) -> list[int]:
        return [step for step, _ in self.picked]

    @property
    def folders(self) -> list[Path]:
        return [folder for _, folder in self.picked]

    def line(self) -> str:
        """One line saying which checkpoints were taken, and why (`took`)."""
        return took(self.run, list(self.picked), self.selection)


def take(run_dir: str | Path, selection: Selection, level: str = "model", option: str = "--steps") -> Taken:
    """The checkpoints of the run folder `run_dir` that `selection` picks at `level` (`select_steps`,
    and its errors), oldest first."""
    run = Path(run_dir)
    return Taken(run, selection, tuple(select_steps(run, selection, level, option)))


def is_run_folder(path: str | Path) -> bool:
    """A folder whose checkpoints are its step_N subfolders: no weights of its own."""
    path = Path(path)
    return path.is_dir() and not runs.has_weights(path) and not (path / runs.MODEL_CONFIG).is_file()


@dataclass
class Checkpoint:
    """One model's weights: the safetensors files, the folder holding them, and where it came from."""

    path: Path  # what identifies it: a file or a folder
    files: list[Path]  # the safetensors files holding its tensors
    folder: Path  # where config.json / tokenizer files would sit
    step: int | None = None  # training step, for `merit train` checkpoints
    run: Path | None = None  # the run folder it belongs to, if any
    notes: list[str] = field(default_factory=list)
    tensors: dict[str, tuple[Path, str, tuple[int, ...]]] = field(default_factory=dict)  # name -> (file, dtype, shape)
    name: str | None = None  # how the user named it where that is not its path: a hub model's ORG/NAME@REV
    tokens: int | None = None  # tokens trained on, where its name says (a hub revision's)
    fetch: Callable[[], Path] | None = None  # a hub revision downloaded only when read (`held`)
    drop: Callable[[Path], object] | None = None  # frees its weights once read (`held`)
    _holding: bool = field(default=False, repr=False, compare=False)  # inside `held`: fetched, not yet dropped

    @property
    def config_path(self) -> Path | None:
        p = self.folder / runs.MODEL_CONFIG
        return p if p.is_file() else None

    @property
    def label(self) -> str:
        return self.name or display(self.path)  # printable even when the file name is not UTF-8

    @contextmanager
    def held(self) -> Iterator[Checkpoint]:
        """The checkpoint with its files on disk while the caller reads it: a hub revision read with
        `HubRequest.drop_weights` is downloaded (and validated) here and its weights deleted after.
        Held again inside (eval scores a revision, then inspect's probe reads it), it is fetched once
        and its weights deleted when the outer hold ends."""
        if self.fetch is None or self._holding:
            yield self
            return
        folder = self.folder = self.fetch()
        self._holding = True
        try:
            self.files, self.tensors = _weight_files(folder), {}
            _read_tensors(self)
            yield self
        finally:
            self._holding = False
            if self.drop is not None:
                self.drop(folder)


def _read_step(folder: Path) -> int | None:
    """The step a checkpoint folder says it holds (its trainer_state.json, else its `step_N` name)."""
    state = optional_trainer_state(folder, strict=False)
    return state.step if state is not None else runs.parse_step(folder.name)


def _weight_files(folder: Path) -> list[Path]:
    """model.safetensors or the shards its index names ([] for neither); an absurd config.json refused."""
    check_config_size(folder / runs.MODEL_CONFIG)
    if (folder / WEIGHTS_NAME).is_file():
        return [folder / WEIGHTS_NAME]
    if (folder / INDEX_NAME).is_file():
        return index_files(folder / INDEX_NAME)
    return []


def _folder_checkpoint(folder: Path) -> Checkpoint | None:
    refuse_special_files(folder)
    files = _weight_files(folder)
    if not files:
        return None
    return Checkpoint(path=folder, files=files, folder=folder, step=_read_step(folder))


def _describe(folder: Path, limit: int = 8) -> str:
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir())
    if not names:
        return "it is empty"
    more = f", ... ({len(names)} entries)" if len(names) > limit else ""
    return "found: " + ", ".join(names[:limit]) + more


def _from_folder(folder: Path, selection: Selection) -> list[Checkpoint]:
    single = _folder_checkpoint(folder)
    if single is not None:
        return [single]
    steps: list[Checkpoint] = []
    skipped: list[str] = []
    for step, sub in runs.step_folders(folder):
        try:
            ckpt = _folder_checkpoint(sub) if runs.has_weights(sub) else None
        except PermissionError:  # a step folder this user may not read: skipped, and said so
            ckpt = None
        if ckpt is None:
            skipped.append(sub.name)
            continue
        ckpt.run = folder
        if ckpt.step is None:
            ckpt.step = step
        steps.append(ckpt)
    if steps:
        steps.sort(key=lambda c: c.step if c.step is not None else -1)  # each has its step here
        if skipped:
            steps[0].notes.append(f"skipped incomplete checkpoint folders: {', '.join(sorted(skipped))}")
        if selection.kind == "latest":
            return steps[-1:]
        if selection.kind == "steps":
            picked = dict(select_steps(folder, selection, "weights"))
            return [c for c in steps if c.folder in picked.values()]
        return steps
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix.lower() in PICKLE_SUFFIXES)
    if pickles:
        raise refuse_pickle(
            folder / pickles[0], f"a pickle-based checkpoint ({pickles[0]}) with no safetensors weights"
        )
    raise CheckpointError(
        f"no checkpoint in {folder}: expected {WEIGHTS_NAME}, {INDEX_NAME} or step_* folders; {_describe(folder)}"
    )


def find_checkpoints(
    path: str | Path, selection: Selection = ALL, verify: bool = True, hub: HubRequest | None = None
) -> list[Checkpoint]:
    """Resolve a user path to its checkpoints (validated), in step order for a run folder; a run
    folder's steps as `selection` picks them, a hub model's revisions as `hub` asks (`hub_checkpoints`).
    With `verify`, each checkpoint's files are checked against the checksums its trainer_state.json
    records (CheckpointError on a mismatch)."""
    model = parse_hub_model(str(path))
    path = Path(path).expanduser()
    try:
        if not path.exists() and model is not None:
            found = hub_checkpoints(model, hub or HubRequest())
        else:
            found = _find_checkpoints(path, selection)
    except PermissionError as exc:
        raise CheckpointError(f"cannot read {display(exc.filename or path)}: permission denied") from None
    notes = [SKIPPED] if not verify else [n for n in (verify_checkpoint(c.folder) for c in found) if n is not None]
    if notes:  # said once for the path, on its first checkpoint
        found[0].notes.append(notes[0] if len(found) == 1 or not verify else f"{notes[0]} ({len(notes)} checkpoints)")
    return found


def _find_checkpoints(path: Path, selection: Selection) -> list[Checkpoint]:
    if not path.exists():
        raise CheckpointError(f"checkpoint not found: {display(path)}{runs.missing_step_hint(path)}")
    if path.is_dir():
        found = _from_folder(path, selection)
    elif path.name.endswith(".index.json"):
        found = [Checkpoint(path=path, files=index_files(path), folder=path.parent, step=_read_step(path.parent))]
    else:
        found = [Checkpoint(path=path, files=[path], folder=path.parent, step=_read_step(path.parent))]
    for ckpt in found:
        _read_tensors(ckpt)
    return found


def _read_tensors(ckpt: Checkpoint) -> None:
    """Validate a checkpoint's files and record each tensor's file, dtype and shape."""
    for f in ckpt.files:
        for name, info in validate_safetensors(f).items():
            if name in ckpt.tensors:
                raise CheckpointError(f"tensor {name!r} appears in two shards of {ckpt.path}")
            ckpt.tensors[name] = (f, info["dtype"], tuple(info["shape"]))


def hub_checkpoints(model: HubModel, request: HubRequest) -> list[Checkpoint]:
    """A hub model's checkpoints: its one revision, or the revisions `request.revisions` picks, in step
    order and read as a run (`run` is the repository id; step and tokens from each revision's name).

    Each is fetched and validated now, or, with `request.drop_weights`, when it is read (`held`)."""
    if request.revisions is not None and model.revision is not None:
        raise ConfigError(f"{model}: give the revision once, as ORG/NAME@REV or with --revisions, not both")
    if request.revisions is None:
        revisions = [model.revision]
    else:
        revisions = list(choose_revisions(model.repo_id, list_revisions(model.repo_id), request.revisions))
    found = []
    for revision in revisions:
        one = HubModel(model.repo_id, revision)
        step, tokens = revision_step(revision) if revision is not None else (None, None)
        ckpt = Checkpoint(path=Path(str(one)), files=[], folder=Path(str(one)), step=step, name=str(one), tokens=tokens)
        if request.revisions is not None:
            ckpt.run = Path(model.repo_id)
        if request.drop_weights:
            ckpt.fetch, ckpt.drop = partial(fetch_snapshot, one, request), partial(drop_weights, model.repo_id)
        else:
            ckpt.folder = fetch_snapshot(one, request)  # its path stays the name: ORG/NAME@REV
            ckpt.files = _weight_files(ckpt.folder)
            _read_tensors(ckpt)
        found.append(ckpt)
    return found


class SafetensorsReader(Mapping):
    """A read-only name -> tensor mapping over a checkpoint's files; each tensor is read when asked.

    Every read opens the file afresh, so the memory map lives only as long as the returned
    tensor: reading a whole checkpoint one tensor at a time never holds more than one in memory.
    """

    def __init__(self, checkpoint: Checkpoint):
        if not checkpoint.tensors:
            raise ValueError("checkpoint was not validated; get it from find_checkpoints()")
        self.checkpoint = checkpoint

    def shape(self, name: str) -> tuple[int, ...]:
        return self.checkpoint.tensors[name][2]

    def dtype(self, name: str) -> str:
        return self.checkpoint.tensors[name][1]

    def __getitem__(self, name: str):
        from safetensors import SafetensorError, safe_open

        file = self.checkpoint.tensors[name][0]
        try:
            with opened_path(file) as checked, safe_open(checked, framework="pt") as handle:
                return handle.get_tensor(name)
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"cannot read {name!r} from {display(file)}: {exc}") from None

    def __contains__(self, name) -> bool:  # without reading the tensor
        return name in self.checkpoint.tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self.checkpoint.tensors)

    def __len__(self) -> int:
        return len(self.checkpoint.tensors)


def take_revisions(model: HubModel, request: HubRequest) -> Taken:
    """The revisions of a hub model that `request.revisions` picks, as a Taken (run: the repository id;
    each revision as `ORG/NAME@REV`, its step from its name, 0 where it names none), nothing fetched."""
    if request.revisions is None or model.revision is not None:
        raise ConfigError(f"{model}: give the revision once, as ORG/NAME@REV or with --revisions, not both")
    picked = choose_revisions(model.repo_id, list_revisions(model.repo_id), request.revisions)
    named = tuple((revision_step(r)[0] or 0, Path(str(HubModel(model.repo_id, r)))) for r in picked)
    return Taken(Path(model.repo_id), ALL, named)
