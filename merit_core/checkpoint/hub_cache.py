"""Hub models on this machine: revisions listed, snapshots fetched into the hub cache, checked, and freed.

A hub model's revision becomes a folder of the Hugging Face cache (`$HF_HUB_CACHE`, else
`$HF_HOME/hub`, else `~/.cache/huggingface/hub`): `models--ORG--NAME/snapshots/SHA/`, named by
`refs/REV`. The cache is huggingface_hub's own, shared with transformers: what is there is reused,
and an interrupted download resumes from its `.incomplete` file when run again.

Online, the revisions are the repository's branches and tags (`list_repo_refs`), and a revision's
file list is read before anything is downloaded: a repository whose weights are only pickles, whose
config.json is absurdly large, or (without trust_remote_code) whose config asks to run its own code
(`auto_map`) is refused then; only the safetensors weights, config and tokenizer files at the
repository's top level are downloaded. Offline (HF_HUB_OFFLINE, or the hub does not answer) the
revisions are the cache's `refs/` and the snapshot must already be there; the same checks apply.
"""

from __future__ import annotations

import errno
import json
import os
import re
from pathlib import Path
from typing import Any

from merit_core.checkpoint.hub_revisions import (
    DEFAULT_REVISION,
    HubModel,
    HubRequest,
    RevisionChoice,
    choose_revisions,
    nearest_revisions,
)
from merit_core.checkpoint.runs import INDEX_NAME, MODEL_CONFIG, TOKENIZER_FILES, WEIGHTS_NAME
from merit_core.checkpoint.safe import PICKLE_SUFFIXES, index_files, open_regular, refuse_pickle
from merit_core.errors import CheckpointError, DiskFull, first_line
from merit_core.file_reading import display
from merit_core.hub import offline_by_env, prefer_offline
from merit_core.progress import Progress, ProgressFn, report_to

__all__ = [
    "MAX_CONFIG_BYTES",
    "cache_root",
    "check_config_size",
    "check_snapshot",
    "drop_weights",
    "fetch_snapshot",
    "list_revisions",
    "repo_dir",
]

MAX_CONFIG_BYTES = 4 * 1024 * 1024  # a model's config.json is a few kB; one past this is not one
# The files read from a hub model: weights as safetensors only, the config, the tokenizer.
METADATA_FILES = (MODEL_CONFIG, "generation_config.json", INDEX_NAME, *TOKENIZER_FILES)
_SHA = re.compile(r"[0-9a-f]{40}")


def cache_root() -> Path:
    """The hub cache folder, as huggingface_hub finds it (read now, not when it was imported)."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def repo_dir(repo_id: str) -> Path:
    """The cache folder of a hub model: models--ORG--NAME."""
    return cache_root() / ("models--" + repo_id.replace("/", "--"))


def _offline() -> bool:
    return offline_by_env() or prefer_offline()


def cached_revisions(repo_id: str) -> list[str]:
    """The revisions the cache names for a model (its refs/, pull requests left out)."""
    refs = repo_dir(repo_id) / "refs"
    if not refs.is_dir():
        return []
    names = (p.relative_to(refs).as_posix() for p in refs.rglob("*") if p.is_file() and not p.is_symlink())
    return sorted(n for n in names if not n.startswith("pr/"))


def list_revisions(repo_id: str) -> list[str]:
    """The revisions of a hub model: its branches and tags online, the cache's refs offline."""
    if _offline():
        found = cached_revisions(repo_id)
        if not found and not (repo_dir(repo_id) / "snapshots").is_dir():
            raise _not_cached(repo_id)
        return found
    from huggingface_hub import HfApi

    try:
        refs = HfApi().list_repo_refs(repo_id)
    except Exception as exc:  # noqa: BLE001 - the hub's client raises HTTP, connection and validation errors
        raise _hub_error(repo_id, exc) from None
    return sorted({r.name for r in [*refs.branches, *refs.tags]})


def _not_cached(repo_id: str, revision: str | None = None) -> CheckpointError:
    what = repo_id if revision is None else f"{repo_id}@{revision}"
    return CheckpointError(
        f"{what} is not in the hub cache ({display(cache_root())}) and the hub is offline "
        "(HF_HUB_OFFLINE, or it does not answer): run once online to download it, or set HF_HUB_CACHE"
    )


def _hub_error(repo_id: str, exc: BaseException) -> CheckpointError:
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    if isinstance(exc, GatedRepoError):
        return CheckpointError(f"{repo_id} is gated on the hub: accept its terms and log in (hf auth login)")
    if isinstance(exc, RepositoryNotFoundError):
        return CheckpointError(f"{repo_id}: no such model on the hub (or it is private: log in with hf auth login)")
    return CheckpointError(f"cannot read {repo_id} from the hub: {first_line(exc)}")


def _read_ref(repo_id: str, revision: str) -> str | None:
    """The commit a cached revision names (refs/REV), or the revision itself when it is a cached commit."""
    folder = repo_dir(repo_id)
    if ".." in revision.split("/") or revision.startswith("/"):
        return None  # a name, never a way out of refs/
    if _SHA.fullmatch(revision) and (folder / "snapshots" / revision).is_dir():
        return revision
    ref = folder / "refs" / revision
    if not ref.is_file() or ref.is_symlink():
        return None
    with open_regular(ref) as fh:
        sha = fh.read(200).decode("ascii", "replace").strip()
    return sha if _SHA.fullmatch(sha) else None


def fetch_snapshot(model: HubModel, request: HubRequest | None = None) -> Path:
    """The checked snapshot folder of `model`'s revision, downloaded first when online and needed.

    CheckpointError in one line for a model or revision that does not exist (naming the revisions
    that do, nearest first), one offline and not cached, pickle-only weights, a config that asks to
    run code (without trust_remote_code), a config.json past MAX_CONFIG_BYTES or a missing shard;
    DiskFull when the disk fills during the download."""
    request = request or HubRequest()
    revision = model.revision or DEFAULT_REVISION
    if _offline():
        sha = _read_ref(model.repo_id, revision)
        folder = repo_dir(model.repo_id) / "snapshots" / (sha or "")
        if sha is None or not folder.is_dir():
            cached = cached_revisions(model.repo_id)
            if not cached:
                raise _not_cached(model.repo_id, model.revision)
            near = ", ".join(nearest_revisions(revision, cached))
            raise CheckpointError(
                f"{model.repo_id} has no revision {revision!r} in the hub cache (offline); cached nearest: {near}"
            )
        return check_snapshot(folder, str(model), request.trust_remote_code)
    return _download(model.repo_id, revision, request)


def _listing(repo_id: str, revision: str) -> dict[str, int | None]:
    """name -> size of the files at the top level of a revision (read before anything is downloaded)."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RevisionNotFoundError

    try:
        info = HfApi().model_info(repo_id, revision=revision, files_metadata=True)
    except RevisionNotFoundError:
        choose_revisions(repo_id, list_revisions(repo_id), RevisionChoice("list", names=(revision,)), "revision")
        raise CheckpointError(f"{repo_id} has no revision {revision!r}") from None
    except Exception as exc:  # noqa: BLE001 - HTTP, connection and validation errors of the hub's client
        raise _hub_error(repo_id, exc) from None
    return {s.rfilename: s.size for s in info.siblings or [] if "/" not in s.rfilename}


def _wanted(what: str, files: dict[str, int | None], trust_remote_code: bool) -> list[str]:
    """The files to download; refuses pickle-only weights and an absurd config.json before any is."""
    if MODEL_CONFIG not in files:
        raise CheckpointError(f"{what} has no {MODEL_CONFIG} at its top level: not a transformers model")
    size = files[MODEL_CONFIG]
    if size is not None and size > MAX_CONFIG_BYTES:
        raise CheckpointError(
            f"{what}: {MODEL_CONFIG} is {size:,} bytes, past {MAX_CONFIG_BYTES:,}: not a model config"
        )
    weights = [n for n in files if n.endswith(".safetensors")]
    if not weights:
        pickles = sorted(n for n in files if Path(n).suffix.lower() in PICKLE_SUFFIXES)
        if pickles:
            raise refuse_pickle(Path(f"{what}/{pickles[0]}"), "a pickle-based checkpoint with no safetensors weights")
        raise CheckpointError(f"{what} has no safetensors weights ({WEIGHTS_NAME} or shards)")
    code = [n for n in files if n.endswith(".py")] if trust_remote_code else []
    return sorted({*weights, *code, *(n for n in METADATA_FILES if n in files)})


def _download(repo_id: str, revision: str, request: HubRequest) -> Path:
    what = f"{repo_id}@{revision}"
    files = _listing(repo_id, revision)
    wanted = _wanted(what, files, request.trust_remote_code)
    small = [n for n in wanted if not n.endswith(".safetensors")]
    folder = _snapshot_download(repo_id, revision, small, request.progress, what)  # config, tokenizer, index
    refuse_code(folder, what, request.trust_remote_code)  # before any weight is downloaded
    if (folder / INDEX_NAME).is_file():
        shards = _index_shards(folder / INDEX_NAME)
        lacking = sorted(s for s in shards if s not in files)
        if lacking:
            raise CheckpointError(f"{what}: {INDEX_NAME} names shard {lacking[0]}, which the repository lacks")
        wanted = [n for n in wanted if not n.endswith(".safetensors") or n in shards]
    folder = _snapshot_download(repo_id, revision, wanted, request.progress, what)
    return check_snapshot(folder, what, request.trust_remote_code)


def _index_shards(index: Path) -> set[str]:
    try:
        with open_regular(index) as fh:
            names = json.loads(fh.read(MAX_CONFIG_BYTES * 16).decode("utf-8"))["weight_map"].values()
        return {n for n in names if isinstance(n, str)}
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError):
        raise CheckpointError(f"{display(index)} is not a valid sharded-checkpoint index (no weight_map)") from None


def _snapshot_download(repo_id: str, revision: str, files: list[str], progress: ProgressFn | None, what: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(
            snapshot_download(
                repo_id,
                revision=revision,
                allow_patterns=files,
                cache_dir=cache_root(),
                tqdm_class=_progress_bar(report_to(progress), what),
            )
        )
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise DiskFull(
                f"the disk holding {display(cache_root())} filled while downloading {what}: free space or set "
                "HF_HUB_CACHE to a larger disk (a re-run resumes the download)"
            ) from None
        raise _hub_error(repo_id, exc) from None
    except Exception as exc:  # noqa: BLE001 - the hub's client raises HTTP, connection and validation errors
        raise _hub_error(repo_id, exc) from None


def _progress_bar(progress: ProgressFn, what: str) -> type:
    """A tqdm stand-in for snapshot_download: its bytes-written bar becomes Progress events."""

    class Bar:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.desc = str(kwargs.get("desc") or "")
            self.total = kwargs.get("total")
            self.n = int(kwargs.get("initial") or 0)
            self.shown = not self.desc.startswith("Downloading bytes")  # the network's bar, beside the disk's

        def update(self, n: float | None = 1) -> None:
            self.n += int(n or 0)
            self.refresh()

        def refresh(self, *args: Any, **kwargs: Any) -> None:
            if self.shown and self.total:
                progress(
                    Progress("downloading", done=min(self.n, self.total), total=self.total, unit="bytes", item=what)
                )

        def set_postfix_str(self, *args: Any, **kwargs: Any) -> None:
            pass

        def set_description(self, *args: Any, **kwargs: Any) -> None:
            pass

        def close(self) -> None:
            pass

        def __enter__(self) -> Bar:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

    return Bar


def check_config_size(path: Path) -> None:
    """CheckpointError when a config.json is larger than MAX_CONFIG_BYTES (refused before it is parsed)."""
    try:
        size = path.stat().st_size
    except OSError:
        return
    if size > MAX_CONFIG_BYTES:
        raise CheckpointError(f"{display(path)} is {size:,} bytes, past {MAX_CONFIG_BYTES:,}: not a model config")


def refuse_code(folder: Path, what: str, trust_remote_code: bool) -> None:
    """CheckpointError when the model's config.json asks to run code it ships (auto_map), unless trusted."""
    config = folder / MODEL_CONFIG
    if trust_remote_code or not config.is_file():
        return
    check_config_size(config)
    try:
        with open_regular(config) as fh:
            data = json.loads(fh.read().decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        raise CheckpointError(f"{what}: {MODEL_CONFIG} is not readable JSON") from None
    if isinstance(data, dict) and data.get("auto_map"):
        raise CheckpointError(
            f"{what}: {MODEL_CONFIG} asks to run code shipped with the model (auto_map); merit runs it only "
            "with --trust-remote-code (only for models you trust)"
        )


def check_snapshot(folder: Path, what: str, trust_remote_code: bool = False) -> Path:
    """The snapshot folder, checked: a config.json of sane size that runs no code unasked, and
    safetensors weights with every shard present (pickle-only weights refused)."""
    config = folder / MODEL_CONFIG
    if config.is_file():
        check_config_size(config)
    refuse_code(folder, what, trust_remote_code)
    if (folder / INDEX_NAME).is_file():
        index_files(folder / INDEX_NAME)  # a missing shard: one line naming it
    elif not (folder / WEIGHTS_NAME).is_file():
        pickles = sorted(p.name for p in folder.iterdir() if p.suffix.lower() in PICKLE_SUFFIXES)
        if pickles:
            raise refuse_pickle(
                folder / pickles[0], f"{what}'s {pickles[0]}, a pickle-based checkpoint with no safetensors weights"
            )
        raise CheckpointError(f"{what} has no safetensors weights in the hub cache ({display(folder)})")
    return folder


def drop_weights(repo_id: str, folder: Path) -> int:
    """Delete a snapshot's weight files and the cache blobs they point to; returns the bytes freed.

    Only what lies inside the model's cache folder is removed: a link pointing elsewhere is
    unlinked, its target left alone."""
    root = repo_dir(repo_id).resolve()
    freed = 0
    for entry in sorted(folder.iterdir()):
        if not entry.name.endswith(".safetensors"):
            continue
        target = entry.resolve() if entry.is_symlink() else None
        if target is not None and target.is_relative_to(root / "blobs") and target.is_file():
            freed += target.stat().st_size
            target.unlink()
        elif target is None and entry.is_file():
            freed += entry.stat().st_size
        entry.unlink()
    return freed
