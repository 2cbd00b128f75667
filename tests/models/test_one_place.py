"""The package read as text: the probe's numbers are reduced over heads and layers in one module,
the instability rules live in one module, and the probe modules hold no state at module level."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_FILES = sorted(p for package in ("merit_core", "merit_cli") for p in (ROOT / package).rglob("*.py"))
REDUCTION = ROOT / "merit_core" / "precursors.py"
RULES = ROOT / "merit_core" / "instability_rules.py"
PROBE_MODULES = (ROOT / "merit_core" / "models" / "attention_probe.py", REDUCTION)
# the readers of the probe's numbers: each takes its reduction from merit_core.precursors
READERS = (
    "merit_core/models/attention_probe.py",  # a run's eval records
    "merit_core/diagnostics/inspect_report.py",  # inspect's summary, heads and the verdict's input
    "merit_core/instability_rules.py",  # the verdict's rules
    "merit_core/compare/precursor_table.py",  # compare's summary and report
    "merit_core/compare/summary.py",
    "merit_core/evaluation/steps.py",  # eval's trajectories over steps
    "merit_cli/render.py",  # the CLI's log lines
)
PRECURSOR = r"(MAX_ATTENTION_LOGIT|(NORMALIZED_)?(ATTENTION_)?ENTROPY_(MEAN|MIN)|ACTIVATION_RATIO)"


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def test_one_module_says_how_the_probes_numbers_reduce_over_heads_and_layers():
    """Mapping a precursor to max / min / a mean happens in merit_core/precursors.py only, and no
    module reduces the probe's [layers, heads] tensors (max_logits, entropy) itself."""
    table = re.compile(PRECURSOR + r"\s*:\s*(max|min|_mean)\b")
    along_heads = re.compile(r"(max_logits|entropy\[[^]]*\])\.(amax|amin|max|min|mean)\(")
    for path in PACKAGE_FILES:
        if path == REDUCTION:
            assert table.search(_text(path))  # the pattern sees the one table
            continue
        assert not table.search(_text(path)), path
        assert not along_heads.search(_text(path)), path


def test_every_reader_of_the_probe_takes_the_shared_reduction():
    for name in READERS:
        assert "from merit_core.precursors import" in _text(ROOT / name), name
    train = [_text(p) for p in (ROOT / "merit_core" / "train").glob("*.py")]
    assert any("import watch_record" in text and "watch_record(" in text for text in train)  # the watcher's records


def _defined(path: Path) -> set[str]:
    """The names a module defines at its top level (functions, classes, assigned names)."""
    found = set()
    for node in ast.parse(_text(path)).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            found.add(node.name)
        elif isinstance(node, ast.Assign):
            found.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            found.add(node.target.id)
    return found


def _is_rule(name: str) -> bool:
    return name.endswith(("_rule", "_unstable")) or name in {
        "divergence_step",
        "Thresholds",
        "WatchSettings",
        "LOGIT_LIMIT",
        "LOSS_EXCESS",
        "DIVERGENCE_NATS",
        "DIVERGENCE_PERSIST",
    }


def test_the_instability_rules_live_in_one_module():
    where = {path: sorted(n for n in _defined(path) if _is_rule(n)) for path in PACKAGE_FILES}
    assert {"max_logit_rule", "trend_rule", "divergence_step", "run_unstable", "LOGIT_LIMIT"} <= set(where[RULES])
    assert {str(p.relative_to(ROOT)): names for p, names in where.items() if names and p != RULES} == {}


# what a module may bind at its top level: constants, and read-only wrappers around constants
CONSTANT_CALLS = {"MappingProxyType", "frozenset"}


def _constant(node: ast.expr) -> bool:
    if isinstance(node, ast.Constant):
        return True
    if isinstance(node, ast.Tuple):
        return all(_constant(e) for e in node.elts)
    if isinstance(node, ast.Name):  # a name bound to a constant elsewhere (a metric name, a function)
        return True
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in CONSTANT_CALLS:
        return True
    return False


def _module_state(path: Path) -> list[str]:
    """What a module binds at its top level that can change (a list, dict, set or another object),
    and every `global` or `nonlocal` statement in it."""
    tree = ast.parse(_text(path))
    found = [f"line {n.lineno}: global" for n in ast.walk(tree) if isinstance(n, (ast.Global, ast.Nonlocal))]
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None and not _constant(node.value):
            found.append(f"line {node.lineno}: {ast.unparse(node)[:60]}")
    return found


def test_the_probe_modules_hold_no_state_at_module_level():
    for path in PROBE_MODULES:
        assert _module_state(path) == [], path


def test_the_state_check_sees_planted_state(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("import threading\nA = {}\nB = threading.Lock()\nC = ('x', 1)\ndef f():\n    global A\n")
    assert [line.split(":")[0] for line in _module_state(planted)] == ["line 6", "line 2", "line 3"]


# What the probe measured of a layer or head, as inspect's layer and head records name it.
MEASURED = (
    "max_attention_logit",
    "attention_entropy_mean",
    "attention_entropy_min",
    "normalized_attention_entropy_mean",
    "normalized_attention_entropy_min",
    "activation_max",
    "activation_median",
    "activation_ratio",
    "activation_max_position",
    "activation_max_dim",
)
WEIGHT_RECORDS = ROOT / "merit_core" / "diagnostics" / "weights.py"
INSPECT_FILES = sorted((ROOT / "merit_core" / "diagnostics").glob("*.py")) + sorted((ROOT / "merit_cli").rglob("*.py"))


def _copies(text: str) -> list[str]:
    """Assignments of a measured attribute (`x.max_attention_logit = ...`, `setattr(x, "...", ...)`)."""
    names = "|".join(MEASURED)
    assign = re.compile(rf"\.({names})\s*=(?!=)")
    by_name = re.compile(rf"setattr\([^,]+,\s*['\"]({names})['\"]")
    return [m.group(0) for pattern in (assign, by_name) for m in pattern.finditer(text)]


def test_inspect_reads_the_probes_numbers_from_the_one_record():
    """inspect's layer and head records do not hold copies of the probe's numbers: each measured
    attribute reads the checkpoint's precursors record (precursors.Measured), and no module of
    inspect or the CLI assigns one."""
    declared = re.findall(r"^\s+(\w+) = Measured\(", _text(WEIGHT_RECORDS) + _text(REDUCTION), flags=re.M)
    assert set(declared) == set(MEASURED)
    for path in INSPECT_FILES:
        assert _copies(_text(path)) == [], path


def test_the_copy_check_sees_planted_copies():
    planted = (
        "layer.max_attention_logit = 3.0\nsetattr(head, 'attention_entropy_min', 1)\nif a.activation_ratio == 2: pass"
    )
    assert _copies(planted) == [".max_attention_logit =", "setattr(head, 'attention_entropy_min'"]


# File names that several packages use for the same kind of thing, each its own command's: the
# figures, the typed result records, the time estimate said before a run, a checkpoint reader.
SHARED_NAMES = {"__init__.py", "plots.py", "results.py", "estimate.py", "checkpoint.py"}


def test_no_two_modules_are_named_alike_for_different_ideas():
    """A module's name says what it holds: outside SHARED_NAMES no file name is used twice in the
    package (a `report.py` of inspect beside one of compare, a `kernels.py` of MERIT's Triton
    backend beside Liger's)."""
    seen: dict[str, list[str]] = {}
    for path in PACKAGE_FILES:
        seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert {name: where for name, where in seen.items() if len(where) > 1 and name not in SHARED_NAMES} == {}
