"""The repository speaks to its users: no tracker numbers and no words of a remote-execution
service in any tracked file. A GPU script is written for the user's own machine (an offline
node the repository is copied to), so its instructions name that node, `--out` and the table.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# what the words look like, not a list of this repository's past lines
FORBIDDEN = {
    "an issue number": r"\b[Ii]ssues? #?\d+|\b[Ii]ssues \d+ and \d+|(?<![\w&/=\"'])#\d{2,5}\b",
    "a pull-request number": r"\bPR #?\d+\b",
    "remote-execution call syntax": r"\brun\(command=|\bcarry=\[|timeout_s=\d",
    "a carried folder": r"\bcarr(y|ied|ies)\b[^.\n]{0,30}\.gpu-wheels|\(carry\b",
    "the service's output variable": r"\$OUT\b|\$\{OUT[}:]",
    "the service's name": r"\bdevice\stool\b|\bdevice\smachine\b|\bbudget_left",
    "the service's call budget": r"\b\d+-minute call\b|\bone call of\b|\bstays warm\b",
}
PATTERN = re.compile("|".join(f"(?P<g{i}>{p})" for i, p in enumerate(FORBIDDEN.values())))
NAMES = list(FORBIDDEN)


def _tracked_text_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked files cannot be listed")
    files = []
    for name in out.decode().split("\0"):
        path = ROOT / name
        if name and path.is_file() and not path.is_symlink() and path.stat().st_size < 2_000_000:
            files.append(path)
    return files


def offending_lines(text: str) -> list[tuple[int, str, str]]:
    """(line number, what, the line) for each forbidden phrase in `text`."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for match in PATTERN.finditer(line):
            what = NAMES[int(match.lastgroup[1:])]
            found.append((number, what, line.strip()[:160]))
    return found


def test_no_tracked_file_cites_an_issue_number_or_a_remote_execution_service():
    this = Path(__file__).resolve()
    found = []
    for path in _tracked_text_files():
        if path.resolve() == this:
            continue  # the patterns themselves
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # binary files (images, checkpoints)
        found += [f"{path.relative_to(ROOT)}:{n}: {what}: {line}" for n, what, line in offending_lines(text)]
    assert found == [], "\n".join(found)


@pytest.mark.parametrize(
    "line, what",
    [
        # the samples are split in two literals so that this file does not hold the phrases it forbids
        ("# -- hostile files (issue " + "21) --", "an issue number"),
        ("the GPU check of issues " + "11 and 19", "an issue number"),
        ("fixed in #128", "an issue number"),
        ('run(command="bash x.sh", carry' + '=[".gpu-wheels"])', "remote-execution call syntax"),
        ("on the GPU machine (carry .gpu-wheels)", "a carried folder"),
        ("logs go to $OUT", "the service's output variable"),
        ("in one 10-minute call on one H200", "the service's call budget"),
        ("kept while the machine stays warm", "the service's call budget"),
    ],
)
def test_the_patterns_catch_what_they_are_for(line, what):
    assert [w for _, w, _ in offending_lines(line)][:1] == [what]


@pytest.mark.parametrize(
    "line",
    [
        "You must cause any modified files to carry prominent notices",
        "AdamW, LAMB and MERIT carry a table of measured lrs",
        'OUTDIR=$(mktemp -d "$PWD/gpu_check-XXXX")',
        "color: #fff; rank #0",
        "bash benchmarks/gpu_check.sh --out DIR --budget 300",
    ],
)
def test_ordinary_words_pass(line):
    assert offending_lines(line) == []
