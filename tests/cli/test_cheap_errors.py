"""Mistakes that need no model are answered before torch and transformers load (seconds of CPU):
a misspelt model, optimizer or config name, a reused --out, a missing path. Each exits 2 with one
line, and at exit neither torch nor transformers is in sys.modules (benchmarks/README.md has the
CPU times before and after)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from merit_core.checkpoint import runs
from merit_core.checkpoint.state import STATE_JSON

ROOT = Path(__file__).resolve().parents[2]

# Runs each command in one interpreter, in turn: its exit code, its stderr lines and whether torch or
# transformers had been imported by then; last, a control that the check sees an import of torch.
RUNNER = textwrap.dedent("""
    import contextlib, io, json, sys
    from merit_cli.main import cli
    found = []
    for args in json.loads(sys.argv[1]):
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                cli.main(args, prog_name="merit", standalone_mode=True)
                code = 0
            except SystemExit as exc:
                code = exc.code
        lines = [line for line in err.getvalue().splitlines() if line.strip()]
        heavy = sorted(m for m in ("torch", "transformers") if m in sys.modules)
        found.append({"args": args, "code": code, "lines": lines, "heavy": heavy})
    import merit_core.train  # the control: the training package imports torch
    found.append({"control": "torch" in sys.modules})
    print(json.dumps(found))
""")


def _run_folder(folder: Path) -> Path:
    """A run folder holding one complete checkpoint (its files' names only: nothing reads them here)."""
    runs.mark_run(folder)
    step = folder / "step_1"
    step.mkdir()
    for name in (runs.MODEL_CONFIG, runs.WEIGHTS_NAME, STATE_JSON, runs.STATE_PT):
        (step / name).write_text("{}")
    assert runs.is_complete(step)
    return folder


def test_cheap_errors_exit_2_in_one_line_before_torch_loads(tmp_path):
    used = _run_folder(tmp_path / "used")
    missing = tmp_path / "nothing-here"
    include = ["--tasks", "x", "--include-path", str(missing), "--trust-task-code"]
    cases = [
        ("unknown model 'no-such-model'", ["train", "--model", "no-such-model", "--out", str(tmp_path / "a")]),
        ("unknown model 'nosuch'", ["train", "--set", "model=nosuch", "--out", str(tmp_path / "b")]),
        ("already holds checkpoints; pass --resume", ["train", "--out", str(used)]),
        ("unknown optimizer 'adamz' (did you mean 'adamw'?)", ["train", "--optimizer", "adamz"]),
        ("config file not found: no-such-config", ["train", "no-such-config"]),
        (f"checkpoint not found: {missing}", ["inspect", str(missing)]),
        (f"cannot read probe text {missing}", ["inspect", str(used), "--text-file", str(missing)]),
        (f"checkpoint not found: {missing}", ["eval", str(missing), "--tasks", "builtin"]),
        (f"--include-path {missing} does not exist", ["eval", str(used), *include]),
    ]
    out = subprocess.run(
        [sys.executable, "-c", RUNNER, json.dumps([args for _, args in cases])],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    *results, control = json.loads(out.stdout)
    assert control == {"control": True}  # the check would see torch had a command imported it
    for (expect, _), result in zip(cases, results, strict=True):
        assert result["code"] == 2, result
        assert len(result["lines"]) == 1 and expect in result["lines"][0], result
        assert result["heavy"] == [], result
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()  # nothing made for a failed run
    assert sorted(p.name for p in used.iterdir()) == [runs.RUN_MARKER, "step_1"]
