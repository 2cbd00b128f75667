"""README's install block: what its extras bring, and (opt-in, minutes) the block itself run in a fresh venv.

The fresh-venv test pastes README's ```bash block into bash inside a new virtualenv, with pip's own
configuration of the machine (its default index; the CPU index of the block may be unreachable: then
its line fails and `.[cli]` installs the default index's torch), and checks that the merit command and
the test tools work and that `[dev]` brought no triton. It downloads and installs ~2 GB, so it runs only
with MERIT_TEST_INSTALL=1 (README, "Install").
"""

from __future__ import annotations

import os
import re
import subprocess
import tomllib
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def install_block() -> list[str]:
    """The command lines of README's install block (its first ```bash block after '## Install')."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("## Install") :]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block is not None, "README's Install section has no ```bash block"
    return [line for line in block.group(1).splitlines() if line.strip() and not line.lstrip().startswith("#")]


def _extra(extras: dict[str, list[str]], name: str) -> set[str]:
    """The distribution names an extra brings, its own extras (merit-optim[...]) expanded."""
    names: set[str] = set()
    for requirement in extras[name]:
        match = re.match(r"merit-optim\[([a-z,]+)\]", requirement)
        if match:
            for sub in match.group(1).split(","):
                names |= _extra(extras, sub)
        else:
            names.add(re.split(r"[<>=;\[ ]", requirement, maxsplit=1)[0].lower())
    return names


def test_dev_brings_no_triton_and_the_triton_extra_brings_triton_and_liger():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    assert not {"triton", "liger-kernel"} & _extra(extras, "dev")
    assert {"triton", "liger-kernel", "numpy"} <= _extra(extras, "triton")
    assert _extra(extras, "gpu") == _extra(extras, "triton")


def test_the_install_block_puts_the_cpu_torch_line_first_and_only_without_a_gpu():
    lines = install_block()
    assert lines[0].startswith("command -v nvidia-smi > /dev/null || pip install")
    assert "--index-url https://download.pytorch.org/whl/cpu" in lines[0]
    assert [line.split("#")[0].strip() for line in lines[1:]] == [
        "pip install -e '.[cli]'",
        "pip install -e '.[dev,triton]'",
    ]  # the test set-up CI installs (.ci/run; tests/cli/test_readme.py checks they agree)


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("MERIT_TEST_INSTALL") != "1", reason="installs ~2 GB into a fresh venv: MERIT_TEST_INSTALL=1"
)
def test_readme_install_block_in_a_fresh_venv(tmp_path: Path) -> None:
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    bin_dir = env_dir / "bin"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env |= {"PATH": f"{bin_dir}{os.pathsep}{env['PATH']}", "VIRTUAL_ENV": str(env_dir)}
    script = "\n".join(install_block())  # pasted: no `set -e`, a failing CPU line falls through
    subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, check=True, timeout=3600)
    python = str(bin_dir / "python")
    out = subprocess.run(
        [python, "-c", "import torch, merit_core.optim, pytest, ruff; print(torch.__version__)"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip()
    assert subprocess.run([str(bin_dir / "merit"), "--version"], env=env, cwd=tmp_path).returncode == 0
    # PyPI's CUDA torch depends on triton itself; over a CPU-only torch nothing of [dev] may bring it
    check = (
        "import importlib.util, torch; print(torch.version.cuda is None, importlib.util.find_spec('triton') is None)"
    )
    cpu, no_triton = subprocess.run(
        [python, "-c", check], env=env, cwd=tmp_path, capture_output=True, text=True
    ).stdout.split()
    assert cpu == "False" or no_triton == "True", "[dev] installed triton beside a CPU-only torch"
