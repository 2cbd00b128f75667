"""Golden outputs: `merit inspect --json` of a tiny checkpoint and the summary.json of a tiny
`merit compare --quick`, compared with the files in tests/golden/ once times, paths and versions
are taken out. They guard refactors that should change no output.

A change that alters these outputs on purpose regenerates them:
    MERIT_REGEN_GOLDEN=1 python -m pytest -q tests/cli/test_golden.py
and the diff of tests/golden/ shows what changed.
"""

import json
import math
import os
import re
from pathlib import Path

import pytest

from tests.cli_runs import invoke, train_args

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
REGEN = os.environ.get("MERIT_REGEN_GOLDEN") == "1"
DATA_SENTENCES = 400
# Keys whose values depend on the clock, the machine or the install, not on the computation (the
# throughput, the floating-point environment: CPU, BLAS, instruction sets, threads, and the provenance:
# commit, times, host).
VOLATILE = re.compile(
    r"(^|_)(time|times|elapsed|elapsed_s|seconds|date|started|finished_at|version|host|device_name|environment)$"
    r"|^tokens_per_s|^provenance$|^cpu_capability$"
)


def _stable(value, paths: dict[str, str]):
    """`value` with volatile keys dropped, the given paths replaced by their names (the fixtures'
    folders are numbered by the order tests ran in) and floats rounded to 6 significant digits (CPU
    float sums may differ in the last bits across builds)."""
    if isinstance(value, dict):
        return {k: _stable(v, paths) for k, v in value.items() if not VOLATILE.search(k)}
    if isinstance(value, list):
        return [_stable(v, paths) for v in value]
    if isinstance(value, str):
        for path, name in paths.items():
            value = value.replace(path, name)
        return value
    if isinstance(value, float) and math.isfinite(value):
        return float(f"{value:.6g}")
    return value


def _check(name: str, actual) -> None:
    path = GOLDEN / name
    if REGEN:
        path.write_text(json.dumps(actual, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    assert path.is_file(), f"{path} is missing: run with MERIT_REGEN_GOLDEN=1 to write it"
    expected = json.loads(path.read_text(encoding="utf-8"))
    _close(expected, actual, name)


def _close(expected, actual, where: str) -> None:
    """Equal, floats within a relative 1e-4 (rounded to 6 digits, and CPU kernels may differ slightly)."""
    if isinstance(expected, dict) and isinstance(actual, dict):
        assert sorted(expected) == sorted(actual), (where, sorted(set(expected) ^ set(actual)))
        for key in expected:
            _close(expected[key], actual[key], f"{where}.{key}")
    elif isinstance(expected, list) and isinstance(actual, list):
        assert len(expected) == len(actual), where
        for i, (e, a) in enumerate(zip(expected, actual)):
            _close(e, a, f"{where}[{i}]")
    elif isinstance(expected, float) and isinstance(actual, float):
        assert math.isclose(expected, actual, rel_tol=1e-4, abs_tol=1e-7), (where, expected, actual)
    else:
        assert expected == actual, (where, expected, actual)


def test_stable_drops_volatile_keys_and_relativises_paths():
    raw = {"elapsed_s": 1.5, "path": "/t/x/run", "loss": 1.23456789, "merit_version": "1", "n": [2, "/t/x"]}
    assert _stable(raw, {"/t/x": "<tmp>"}) == {"path": "<tmp>/run", "loss": 1.23457, "n": [2, "<tmp>"]}


def test_close_reports_a_changed_value():
    with pytest.raises(AssertionError):
        _close({"a": [1.0, 2.0]}, {"a": [1.0, 2.1]}, "x")
    _close({"a": [1.0, 2.0]}, {"a": [1.0, 2.00001]}, "x")


def _paths(tmp_path, model_cfg, data_dir) -> dict[str, str]:
    return {str(model_cfg.parent): "<model>", str(data_dir): "<data>", str(tmp_path): "<tmp>"}


def test_inspect_json_is_unchanged(tmp_path, model_cfg, data_dir):
    run = tmp_path / "run"
    assert invoke(train_args(model_cfg, data_dir, run, "--steps", "2")).exit_code == 0
    out = tmp_path / "inspect.json"
    args = ["inspect", str(run), "-o", str(out), "--device", "cpu", "--hessian", "--hessian-iters", "3"]
    result = invoke([*args, "--hutchinson-samples", "2"])
    assert result.exit_code == 0, result.output
    _check("inspect.json", _stable(json.loads(out.read_text()), _paths(tmp_path, model_cfg, data_dir)))


def test_compare_summary_is_unchanged(tmp_path, model_cfg, data_dir):
    out = tmp_path / "cmp"
    sets = [a for k, v in dict(eval_batches=1, eval_batch_size=4, log_every=1).items() for a in ("--set", f"{k}={v}")]
    args = ["compare", "--quick", "--optimizers", "adamw,merit", "--batch-sizes", "2", "--tokens", "256"]
    args += ["--model", str(model_cfg), "--data", str(data_dir), "--seq-len", "32", "--jobs", "1", "--out", str(out)]
    result = invoke([*args, *sets])
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "summary.json").read_text())
    _check("compare_summary.json", _stable(summary, _paths(tmp_path, model_cfg, data_dir)))
