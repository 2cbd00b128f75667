"""The offline GPU kit (benchmarks/): its wheel set covers what the CLI imports, and its scripts'
step tables fit their time budgets. No network, no GPU: pyproject, the image list and the
installed packages' metadata are read here.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"


def _gpu_wheels():
    spec = importlib.util.spec_from_file_location("gpu_wheels", BENCH / "gpu_wheels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CLI_MODULES_AT_START = """
import json, sys
import merit_cli.main, merit_cli.train_cmd, merit_cli.eval_cmd, merit_cli.inspect_cmd
import merit_cli.compare_cmd, merit_cli.prepare_cmd, merit_core.train.training_run
from merit_core.extras import CLI_MODULES
top = {name.split(".")[0] for name in sys.modules} | set(CLI_MODULES)
print(json.dumps(sorted(m for m in top if m not in sys.stdlib_module_names and not m.startswith("_"))))
"""


def test_every_module_the_cli_imports_at_start_is_in_the_image_or_a_fetched_wheel():
    gw = _gpu_wheels()
    image = gw.image_packages()
    pins, missing = gw.wheel_set("3.12")
    assert missing == []
    assert {"tomli-w", "liger-kernel", "lm-eval", "datasets", "pytorch-optimizer"} <= set(pins)
    assert not set(pins) & image  # the image's packages are never fetched again
    out = subprocess.run(
        [sys.executable, "-c", CLI_MODULES_AT_START], capture_output=True, text=True, cwd=ROOT, check=True
    ).stdout
    modules = json.loads(out.strip().splitlines()[-1])
    dists = md.packages_distributions()
    uncovered = {}
    for module in modules:
        if module in ("merit_core", "merit_cli"):
            continue  # the repository itself, copied to the node
        names = {gw.normalize(d) for d in dists.get(module, [])}
        assert names, f"{module}: no installed distribution provides it"
        if not names & (image | set(pins)):
            uncovered[module] = sorted(names)
    assert uncovered == {}, f"neither in benchmarks/gpu_image_packages.txt nor fetched: {uncovered}"


def test_wheel_set_follows_markers_and_names_an_untested_requirement(tmp_path):
    gw = _gpu_wheels()
    pins, _ = gw.wheel_set("3.12", image={"torch"})
    assert "transformers" in pins and "numpy" in pins  # not in this image: fetched, with what they need
    assert "torch" not in pins
    assert all(version == md.version(name) for name, version in pins.items())  # the tested versions
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text(
        "[project.optional-dependencies]\n"
        'cli = ["merit-optim[gpu]", "click>=1", "tomli>=1; python_version < \'3.11\'"]\n'
        'gpu = ["no-such-dist-here>=1"]\n'
    )
    pins, missing = gw.wheel_set("3.12", image=set(), pyproject=pyproject)
    assert missing == ["no-such-dist-here>=1"]  # the self-reference [gpu] was followed
    assert "click" in pins and "tomli" not in pins  # a marker for older Pythons does not apply
    _, missing = gw.wheel_set("3.10", image=set(), pyproject=pyproject)
    assert "no-such-dist-here>=1" in missing and any(m.startswith("tomli") for m in missing)  # applies on 3.10
