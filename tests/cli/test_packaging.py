"""What a pip install gets: declared dependencies, extras, package data, the missing-extra message."""

import ast
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# imported only by optional features that say what to install when missing (trackers, integrations)
OPTIONAL_BY_DESIGN = {"tensorboard", "wandb", "mlflow", "lightning", "pytorch_lightning"}
# import name -> distribution name, where they differ
DISTRIBUTION = {"lm_eval": "lm-eval", "pytorch_optimizer": "pytorch-optimizer", "yaml": "pyyaml"}


def _requirement_name(req: str) -> str:
    name = req
    for sep in "[<>=!~; ":
        name = name.split(sep)[0]
    return name.strip().lower().replace("_", "-")


def _third_party_imports() -> set[str]:
    names = set()
    for folder in ("merit_core", "merit_cli"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names.update(a.name.split(".")[0] for a in node.names)
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n not in ("merit_core", "merit_cli", "__future__")}


def test_every_imported_package_is_declared():
    project = PYPROJECT["project"]
    declared = {_requirement_name(r) for r in project["dependencies"]}
    for reqs in project["optional-dependencies"].values():
        declared |= {_requirement_name(r) for r in reqs}
    imported = _third_party_imports() - OPTIONAL_BY_DESIGN
    assert "torch" in imported and "pyarrow" in imported
    missing = {DISTRIBUTION.get(n, n).replace("_", "-") for n in imported} - declared
    assert not missing, f"imported but not declared in pyproject.toml: {sorted(missing)}"


def test_base_install_is_torch_alone_and_extras_cover_the_cli():
    project = PYPROJECT["project"]
    assert [_requirement_name(r) for r in project["dependencies"]] == ["torch"]
    extras = project["optional-dependencies"]
    cli = {_requirement_name(r) for r in extras["cli"]}
    assert {"click", "rich", "transformers", "lm-eval", "datasets", "pyarrow", "matplotlib", "numpy"} <= cli
    assert "pytorch-optimizer" in {_requirement_name(r) for r in extras["baselines"]}
    assert "merit-optim[baselines]" in extras["cli"] and "merit-optim[cli]" in extras["dev"]
    from merit_core.extras import CLI_MODULES

    # the one-line message checks exactly what the extra installs
    assert {_requirement_name(p) for p in CLI_MODULES.values()} == (cli - {"merit-optim"}) | {"pytorch-optimizer"}


def test_metadata_license_python_and_package_data():
    project = PYPROJECT["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    assert "Apache License" in (ROOT / "LICENSE").read_text() and "Version 2.0" in (ROOT / "LICENSE").read_text()
    assert project["requires-python"] == ">=3.11"
    assert not any(c.startswith("License ::") for c in project["classifiers"])  # SPDX expression instead
    assert (ROOT / "merit_core" / "py.typed").is_file()
    data = PYPROJECT["tool"]["setuptools"]["package-data"]
    assert "py.typed" in data["merit_core"] and data["merit_core.shipped_configs"] == ["*.toml"]
    assert data["merit_core.optim.merit.csrc"] == ["*.cpp"]
    assert project["scripts"]["merit"] == "merit_cli.entry:main"


def test_the_wheel_lists_every_package_and_ships_the_top_level_configs():
    """pyproject.toml names the packages (the shipped configs are mapped in from configs/): a new
    package folder left out of the list would be missing from the wheel."""
    setuptools = PYPROJECT["tool"]["setuptools"]
    folders = {
        ".".join(path.relative_to(ROOT).parts)
        for folder in ("merit_core", "merit_cli")
        for path in [ROOT / folder, *(ROOT / folder).rglob("*")]
        if path.is_dir() and path.name != "__pycache__" and not path.name.startswith(".")
    }
    assert {"merit_core.optim.merit.triton", "merit_core.optim.merit.csrc"} <= folders  # code and data folders
    assert set(setuptools["packages"]) == folders | {"merit_core.shipped_configs"}
    assert setuptools["package-dir"] == {"merit_core.shipped_configs": "configs"}
    assert not (ROOT / "merit_core" / "configs").exists()  # one source of the shipped configs
    assert len(list((ROOT / "configs").glob("*.toml"))) > 5


def test_merit_without_its_extra_prints_one_line(monkeypatch, capsys):
    import importlib.util

    from merit_cli import entry

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "click" else real(name, *a))
    with pytest.raises(SystemExit) as exc:
        entry.main()
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'merit-optim[cli]'" in err and "click" in err


def test_merit_version_without_its_extra(monkeypatch, capsys):
    """`merit --version` answers (exit 0) also without the [cli] extra, as click's option does with it."""
    import importlib.util

    from merit_cli import entry
    from merit_core.version import __version__

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "click" else real(name, *a))
    monkeypatch.setattr(sys, "argv", ["merit", "--version"])
    with pytest.raises(SystemExit) as exc:
        entry.main()
    assert exc.value.code == 0
    assert capsys.readouterr().out == f"merit, version {__version__}\n"


def test_optimizer_imports_without_muon_in_torch():
    """MERIT and the registry work on a torch without torch.optim.Muon (< 2.9); muon itself says what it needs."""
    code = textwrap.dedent(
        """
        import torch, torch.optim
        del torch.optim.Muon
        from merit_core import MERIT
        from merit_core.errors import ConfigError
        from merit_core.optim import build_optimizer
        model = torch.nn.Linear(4, 4)
        MERIT(model.parameters(), lr=1e-3)
        build_optimizer("adamw", model)
        try:
            build_optimizer("muon", model)
        except ConfigError as exc:
            print("ERR", exc)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "ERR optimizer 'muon' needs torch>=2.9" in proc.stdout
