"""Helpers of the offline GPU scripts (gpu_check.sh, gpu_speed.sh, check_gpu_wheels.sh).

    python benchmarks/gpu_kit.py local-tasks DIR                  # two small lm-eval tasks, offline
    python benchmarks/gpu_kit.py start OUT/results.json --script NAME --mode TEXT --budget SECONDS
    python benchmarks/gpu_kit.py record OUT/results.json STEP STATUS SECONDS LIMIT [--rows FILE] [--summary TEXT]
    python benchmarks/gpu_kit.py junit REPORT.xml ROWS.json       # pytest's report as rows
    python benchmarks/gpu_kit.py table OUT/results.json           # the final table, from what finished

results.json is rewritten (atomically) after every step, so a script cut off at any point leaves
the steps that finished: {"script", "budget_s", "steps": [{"step", "status", "seconds", "limit_s",
"summary", "rows": [...]}]}. A step's rows come from the JSON file it wrote (a list of objects,
or one object), read even when the step was cut off: train_throughput.py rewrites its file after
each row. `table` prints one line per step and then each step's rows, and names the steps that
were cut (timed out or skipped for the budget).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def write_json(path: Path, value) -> None:
    """Replace `path` with `value` as JSON in one rename (a reader never sees half a file)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        json.dump(value, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def local_tasks(root: Path) -> None:
    """The two local lm-eval tasks of the test suite (a LAMBADA-like and a wikitext-like one)."""
    sys.path.insert(0, str(ROOT))
    from tests.eval.local_tasks import LOCAL_TASKS, write_local_tasks

    root.parent.mkdir(parents=True, exist_ok=True)
    write_local_tasks(root)
    print(f"local tasks {', '.join(LOCAL_TASKS)} in {root}")


def junit_rows(xml: Path, keep: str = "test_merit_cuda_sizes") -> list[dict]:
    """Rows of a pytest --junitxml report (test, outcome, seconds, message): every test of the
    module `keep` (the NaN/Inf table and real shapes on CUDA) and every test that did not pass
    or skip; the summary line counts the rest."""
    import xml.etree.ElementTree as ET

    rows = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (node.get("message") or "").splitlines()[0][:140] if node.get("message") else ""
        module = case.get("classname", "").rsplit(".", 1)[-1]
        if module != keep and outcome in ("passed", "skipped"):
            continue
        test = f"{module}::{case.get('name')}"
        rows.append({"test": test, "outcome": outcome, "s": float(case.get("time") or 0), "message": message})
    return rows


def _rows(path: Path | None) -> list:
    if path is None or not path.is_file():
        return []
    try:
        value = json.loads(path.read_text())
    except ValueError:
        return [{"error": f"{path.name} is not JSON (cut off while writing?)"}]
    if isinstance(value, dict) and isinstance(value.get("rows"), list):
        return value["rows"]  # a table with its heading fields (kernel_resources.py)
    return value if isinstance(value, list) else [value]


def record(results: Path, step: str, status: str, seconds: float, limit: float, rows: Path | None, summary: str):
    data = json.loads(results.read_text()) if results.is_file() else {"steps": []}
    entry = {"step": step, "status": status, "seconds": seconds, "limit_s": limit, "summary": summary}
    data["steps"].append({**entry, "rows": _rows(rows)})
    write_json(results, data)


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return str(value).replace("|", "/")


def table(results: Path) -> str:
    data = json.loads(results.read_text())
    steps = data["steps"]
    lines = [f"## {data.get('script', 'gpu script')}: {data.get('mode', '')}", ""]
    lines += ["| step | status | s | limit s | result |", "|---|---|---:|---:|---|"]
    for s in steps:
        lines.append(
            f"| {s['step']} | {s['status']} | {s['seconds']:.0f} | {s['limit_s']:.0f} | {_cell(s['summary'])} |"
        )
    for s in steps:
        rows = [r for r in s["rows"] if isinstance(r, dict)]
        if not rows:
            continue
        columns = list(dict.fromkeys(k for r in rows for k in r))
        lines += ["", f"### {s['step']} ({s['status']})", ""]
        lines += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(_cell(r.get(c, "")) for c in columns) + " |" for r in rows]
    cut = [s["step"] for s in steps if s["status"].startswith(("timed out", "skipped"))]
    failed = [s["step"] for s in steps if s["status"].startswith("failed")]
    total = sum(s["seconds"] for s in steps)
    lines += ["", f"steps: {len(steps)}, {total:.0f} s of a {data.get('budget_s', '?')} s budget"]
    lines.append(f"cut (timed out or skipped): {', '.join(cut) if cut else 'none'}")
    lines.append(f"failed: {', '.join(failed) if failed else 'none'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("local-tasks")
    p.add_argument("dir", type=Path)
    p = sub.add_parser("start")
    p.add_argument("results", type=Path)
    p.add_argument("--script", required=True)
    p.add_argument("--mode", required=True)
    p.add_argument("--budget", type=float, required=True)
    p = sub.add_parser("record")
    p.add_argument("results", type=Path)
    p.add_argument("step")
    p.add_argument("status")
    p.add_argument("seconds", type=float)
    p.add_argument("limit", type=float)
    p.add_argument("--rows", type=Path)
    p.add_argument("--summary", default="")
    p = sub.add_parser("junit")
    p.add_argument("xml", type=Path)
    p.add_argument("json", type=Path)
    p = sub.add_parser("table")
    p.add_argument("results", type=Path)
    args = parser.parse_args(argv)
    if args.command == "local-tasks":
        local_tasks(args.dir)
    elif args.command == "start":
        write_json(args.results, {"script": args.script, "mode": args.mode, "budget_s": args.budget, "steps": []})
    elif args.command == "record":
        record(args.results, args.step, args.status, args.seconds, args.limit, args.rows, args.summary)
    elif args.command == "junit":
        write_json(args.json, junit_rows(args.xml) if args.xml.is_file() else [])
    else:
        print(table(args.results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
