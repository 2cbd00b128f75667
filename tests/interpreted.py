"""Run a test file again in a child pytest with Triton's interpreter on (TRITON_INTERPRET=1).

The variable must be set before any ``@triton.jit`` decorator runs, so a module whose kernels
should run on CPU tensors cannot switch it on for itself once triton is imported: its tests are
collected in the child instead, and the parent checks the child's result.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_under_interpreter(test_file: str | Path, timeout: int = 600) -> tuple[str, str]:
    """(the child's summary line, its report) after asserting that the child pytest passed."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(test_file).resolve())],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    report = proc.stdout[-6000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, report
    return proc.stdout.strip().splitlines()[-1], report
