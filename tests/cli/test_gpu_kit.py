"""The offline GPU kit (benchmarks/): its wheel set covers what the CLI imports, and its scripts'
step tables fit their time budgets. No network, no GPU: pyproject, the image list and the
installed packages' metadata are read here.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"


def _bench(name: str):
    """benchmarks/NAME.py as a module (benchmarks/ is a folder of scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _gpu_wheels():
    return _bench("gpu_wheels")


CLI_MODULES_AT_START = """
import json, sys
import merit_cli.main, merit_cli.train_cmd, merit_cli.eval_cmd, merit_cli.inspect_cmd
import merit_cli.compare_cmd, merit_cli.prepare_cmd, merit_core.train.training_run
from merit_core.extras import CLI_MODULES
# a module with neither a file nor a path is made at run time (cython_runtime, by Cython's extension loader)
loaded = {n for n, m in sys.modules.items() if getattr(m, "__file__", None) or getattr(m, "__path__", None)}
top = {name.split(".")[0] for name in loaded} | set(CLI_MODULES)
print(json.dumps(sorted(m for m in top if m not in sys.stdlib_module_names and not m.startswith("_"))))
"""


def _not_installed(names: tuple[str, ...]) -> list[str]:
    missing = []
    for name in names:
        try:
            md.version(name)
        except md.PackageNotFoundError:
            missing.append(name)
    return missing


def test_every_module_the_cli_imports_at_start_is_in_the_image_or_a_fetched_wheel():
    absent = _not_installed(("triton", "liger-kernel"))
    if absent:  # the wheel set pins the versions installed here, the [triton] extra's included
        pytest.skip(f"needs the [triton] extra (pip install -e '.[dev,triton]'): {', '.join(absent)} not installed")
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
        if not names & (gw.with_requirements(image) | set(pins)):  # the image's packages came with their requirements
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
        'cli = ["merit-optim[gpu]", "click>=1", "no-such-old-python-dist>=1; python_version < \'3.11\'"]\n'
        'gpu = ["no-such-dist-here>=1"]\n'
    )
    pins, missing = gw.wheel_set("3.12", image=set(), pyproject=pyproject)
    assert missing == ["no-such-dist-here>=1"]  # the self-reference [gpu] was followed; the marked one skipped
    assert "click" in pins
    _, missing = gw.wheel_set("3.10", image=set(), pyproject=pyproject)
    # on 3.10 the marker applies (a name installed nowhere, so the result does not depend on this venv)
    assert sorted(missing) == ["no-such-dist-here>=1", 'no-such-old-python-dist>=1; python_version < "3.11"']


def _step_table(script: Path) -> tuple[dict[str, tuple[int, int]], dict[str, int]]:
    """(the script's STEPS table {name: (GPU s, dry-run s)}, the budgets gpu_kit.sh sets for every script)."""
    table = re.search(r"^STEPS=\(\n(.*?)^\)", script.read_text(), re.M | re.S).group(1)
    steps = {}
    for line in table.splitlines():
        name, seconds = line.split("#")[0].strip().split("=")
        gpu, dry = seconds.split(":")
        steps[name] = (int(gpu), int(dry))
    kit = (BENCH / "gpu_kit.sh").read_text()
    keys = ("BUDGET_DEFAULT", "RESERVE", "DRY_BUDGET")
    return steps, {key: int(re.search(rf"^{key}=(\d+)\b", kit, re.M).group(1)) for key in keys}


@pytest.mark.parametrize("script", ["gpu_check.sh", "gpu_speed.sh"])
def test_each_gpu_script_fits_five_minutes_step_by_step(script):
    steps, b = _step_table(BENCH / script)
    assert b["BUDGET_DEFAULT"] <= 300  # five minutes on the GPU node, installs and compiles included
    assert b["DRY_BUDGET"] <= 360  # six on a 2-core CPU
    gpu, dry = sum(g for g, _ in steps.values()), sum(d for _, d in steps.values())
    assert gpu + b["RESERVE"] <= b["BUDGET_DEFAULT"], (gpu, b)
    assert dry + b["RESERVE"] <= b["DRY_BUDGET"], (dry, b)
    assert steps["wheels"][0] > 0 and b["RESERVE"] >= 10
    text = (BENCH / script).read_text().split("kit_start", 1)[1]  # the steps, after the table
    for name in steps:  # every step of the table runs (a step missing from it would stop the script)
        assert name in text, name


def test_results_keep_finished_steps_and_the_table_names_what_was_cut(tmp_path):
    kit = _bench("gpu_kit")
    results = tmp_path / "results.json"
    assert kit.main(["start", str(results), "--script", "gpu_check", "--mode", "test", "--budget", "300"]) == 0
    rows = tmp_path / "rows.json"
    rows.write_text(json.dumps([{"loop": "plain compiled (adamw)", "tokens_per_s": 1.5e5}]))
    kit.record(results, "throughput", "timed out (limit 175 s)", 175.0, 175, rows, "")
    kit.record(results, "eval-fp32", "skipped (budget spent)", 0, 20, None, "not run")
    kit.record(results, "eval-bf16", "failed (rc 1)", 3.0, 20, tmp_path / "absent.json", "see logs")
    data = json.loads(results.read_text())
    assert [s["step"] for s in data["steps"]] == ["throughput", "eval-fp32", "eval-bf16"]
    assert data["steps"][0]["rows"] == [{"loop": "plain compiled (adamw)", "tokens_per_s": 1.5e5}]
    text = kit.table(results)
    assert "| plain compiled (adamw) | 150,000 |" in text  # rows of a step cut off are kept
    assert "cut (timed out or skipped): throughput, eval-fp32" in text
    assert "failed: eval-bf16" in text


def test_throughput_loops_are_named_with_their_optimizer():
    tt = _bench("train_throughput")
    assert tt.parse_loop("merit default (lamb)") == tt.LoopSpec("merit", "default", "lamb")
    assert tt.parse_loop("merit eager", merit_optimizer="merit").label == "merit eager (merit)"
    assert tt.parse_loop("plain compiled").label == "plain compiled (adamw)"
    for bad in ("plain compiled (merit)", "merit fast (adamw)", "compiled"):
        with pytest.raises(ValueError):
            tt.parse_loop(bad)
