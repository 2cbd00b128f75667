"""A Hugging Face hub cache built on disk for the tests: `models--ORG--NAME/refs/REV` holding a commit
id, `snapshots/SHA/` holding the files (plain files, or links into `blobs/` as huggingface_hub
writes them), so that `ORG/NAME@REV` resolves offline exactly as a downloaded model would."""

import hashlib
import os
from pathlib import Path


def commit_of(revision: str) -> str:
    """A 40-hex commit id, one per revision name."""
    return hashlib.sha1(revision.encode()).hexdigest()


def add_revision(cache: Path, repo_id: str, revision: str, source: Path, linked: bool = False) -> Path:
    """Put the files of folder `source` in the cache as `repo_id`'s `revision`; returns its snapshot folder.

    With `linked`, each file is a blob under blobs/ and the snapshot holds relative links to it."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    sha = commit_of(revision)
    snapshot = repo / "snapshots" / sha
    snapshot.mkdir(parents=True, exist_ok=True)
    for file in sorted(source.iterdir()):
        data = file.read_bytes()
        if linked:
            blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
            blob.parent.mkdir(exist_ok=True)
            blob.write_bytes(data)
            os.symlink(os.path.relpath(blob, snapshot), snapshot / file.name)
        else:
            (snapshot / file.name).write_bytes(data)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / revision).write_text(sha)
    return snapshot
