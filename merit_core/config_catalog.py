"""The catalog of shipped configs (the paper's GPU runs, their comparisons, and CPU runs) and the
lookup of a config a command names (a path or a shipped name).

Their source is the top-level `configs/` folder of the repository; the wheel installs the same files
as package data in `merit_core/shipped_configs/` (pyproject.toml maps that package to `configs/`).

A shipped config is named by its file name without `.toml` (`merit train gpt2-small`,
`merit compare compare-gpt2-small`). Files named `compare-*` are `merit compare` specs, the
others `merit train` configs. Each file's header comment opens with what the run is (up to the
first colon or semicolon) and has a `# Cost:` line that begins with the short figure (up to the
first colon); `merit train --list-configs` shows both.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from pathlib import Path

from merit_core.errors import ConfigError

# The installed wheel's copy first, else the checkout's own configs/ (beside merit_core/).
INSTALLED_DIR = Path(__file__).resolve().parent / "shipped_configs"
CONFIG_DIR = INSTALLED_DIR if INSTALLED_DIR.is_dir() else Path(__file__).resolve().parents[1] / "configs"
COMPARE_PREFIX = "compare-"


@dataclass(frozen=True)
class ShippedConfig:
    name: str
    path: Path
    command: str  # "train" or "compare"
    summary: str  # the first line of the header comment
    cost: str  # the short figure of the `# Cost:` line ("" when the file states none)


def shipped_configs() -> list[ShippedConfig]:
    """Every shipped config, train configs first, each group sorted by name."""
    configs = [_describe(path) for path in CONFIG_DIR.glob("*.toml")]
    return sorted(configs, key=lambda c: (c.command != "train", c.name))


def _describe(path: Path) -> ShippedConfig:
    header = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        header.append(line.lstrip("#").strip())
    cost = next((h.removeprefix("Cost:").strip() for h in header if h.startswith("Cost:")), "")
    opening = " ".join(itertools.takewhile(lambda h: h and not h.startswith("Cost:"), header))
    name = path.stem
    return ShippedConfig(
        name=name,
        path=path,
        command="compare" if name.startswith(COMPARE_PREFIX) else "train",
        summary=re.split(r":|;", opening, maxsplit=1)[0].strip(),
        cost=cost.split(":")[0].strip().rstrip("."),
    )


def find_config(spec: str | Path, command: str) -> Path:
    """The file `spec` names for `merit <command>`: an existing path, else a shipped config's bare name.

    Raises ConfigError when it is neither, or when a shipped name belongs to the other command.
    """
    path = Path(spec).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        raise ConfigError(f"config file {path} is a folder; give a .toml file or a shipped config's name")
    name = str(spec).removesuffix(".toml")
    shipped = {c.name: c for c in shipped_configs()}
    if path.parent == Path(".") and name in shipped:
        config = shipped[name]
        if config.command != command:
            raise ConfigError(f"{name} is a `merit {config.command}` config: merit {config.command} {name}")
        return config.path
    names = ", ".join(c.name for c in shipped.values() if c.command == command)
    raise ConfigError(
        f"config file not found: {spec} (shipped {command} configs: {names}; see merit train --list-configs)"
    )
