"""README.md is a manual that works: its shell and Python blocks run as written, offline, in a fresh folder.

The only adaptations: `pip install` lines are skipped (the package under test is installed
already) and so is `python -m pytest` (this is the suite). ```text blocks are outputs, or commands
for other machines (GPUs, clusters), and are not run.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
_BLOCK = re.compile(r"^```(\w+)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
_SKIPPED = ("pip install ", "python -m pytest")


def blocks(kind: str) -> list[str]:
    return [body for lang, body in _BLOCK.findall(README.read_text(encoding="utf-8")) if lang == kind]


def shell_lines(block: str) -> list[str]:
    """The commands of a ```bash block, minus the install and test-suite lines (see the module docstring)."""
    lines = [line.split("  #")[0].strip() for line in block.splitlines()]
    return [line for line in lines if line and not line.startswith("#") and not line.startswith(_SKIPPED)]


def test_readme_is_short_and_gives_the_setup():
    """README.md is a user's manual; what it must not say (issue numbers, words of a borrowed machine's
    service) is checked for every tracked file by tests/cli/test_repository_text.py."""
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 200
    setup = blocks("bash")[0]
    assert "pip install -e '.[cli]'" in setup
    assert "--index-url https://download.pytorch.org/whl/cpu" in text
    assert "python -m pytest -q -n auto --dist loadfile" in text  # the test command CI runs (.ci/run)


def _extras(text: str) -> set[str]:
    """The extras of every `pip install ... -e '.[a,b]'` in `text`."""
    found = re.findall(r"pip install[^\n]*-e '\.\[([\w,-]+)\]'", text)
    return {name for group in found for name in group.split(",")}


def test_readme_installs_every_extra_ci_installs():
    """The README's set-up is the one the suite runs on in CI: its test command then passes as written."""
    ci = _extras((ROOT / ".ci" / "run").read_text(encoding="utf-8"))
    assert {"dev", "triton"} <= ci
    assert ci <= _extras(blocks("bash")[0]), (ci, blocks("bash")[0])


def test_readme_python_runs_without_a_warning(tmp_path):
    """A snippet to copy must not warn (a warning there reads as a mistake in the snippet, or in merit)."""
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    for code in blocks("python"):
        done = subprocess.run(
            [sys.executable, "-W", "always", "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True
        )
        assert done.returncode == 0, f"{code}\n{done.stderr[-3000:]}"
        assert "Warning" not in done.stderr, done.stderr


@pytest.mark.slow
def test_readme_blocks_run_offline(tmp_path):
    shutil.copytree(ROOT / "examples", tmp_path / "examples")  # the README's paths are those of a clone
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    commands = [line for block in blocks("bash") for line in shell_lines(block)]
    assert any(c.startswith("merit train") for c in commands) and any(c.startswith("merit eval") for c in commands)
    for command in commands:
        done = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True)
        assert done.returncode == 0, f"{command}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    for code in blocks("python"):
        done = subprocess.run(
            [sys.executable, "-W", "always", "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True
        )
        assert done.returncode == 0 and "Warning" not in done.stderr, f"{code}\n{done.stderr[-3000:]}"
    assert (tmp_path / "runs" / "first" / "step_5").is_dir() and (tmp_path / "scores.json").is_file()
