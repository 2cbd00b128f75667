"""Import hygiene: no import cycles in the packages (at module level, and counting the imports made
inside functions), and every command's --help stays light."""

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("merit_core", "merit_cli")


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _imported(node: ast.Import | ast.ImportFrom, module: str, modules: dict[str, Path]) -> list[str]:
    """The project modules an import statement loads (a submodule named in `from pkg import sub` counts)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        package = module.split(".") if modules[module].name == "__init__.py" else module.split(".")[:-1]
        package = package[: len(package) - node.level + 1]
        base = ".".join([*package, *([base] if base else [])])
    subs = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in modules]
    return subs if len(subs) == len(node.names) else [base, *subs]


def _statements(tree: ast.Module, function_level: bool) -> list[ast.Import | ast.ImportFrom]:
    """The import statements of a module outside `if TYPE_CHECKING:` blocks: the top-level ones
    (and those in a top-level try), or with `function_level` every one, in functions and methods too."""
    skipped: set[int] = set()
    nodes = list(ast.walk(tree)) if function_level else list(tree.body)
    for node in nodes:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for n in ast.walk(node))
    if function_level:
        return [n for n in nodes if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in skipped]
    found = []
    for node in nodes:
        if id(node) in skipped:
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.Try):
            found.extend(n for n in node.body if isinstance(n, (ast.Import, ast.ImportFrom)))
    return found


def _graph(function_level: bool = False) -> dict[str, set[str]]:
    """module -> the project modules its import runs first (top-level imports, outside TYPE_CHECKING);
    with `function_level`, also the modules its functions import when they run.

    Importing a.b.c also runs the packages a and a.b, except the module's own packages (already
    running when one of their modules is imported)."""
    modules = _modules()
    graph = {}
    for module, path in modules.items():
        own = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 2)}
        edges = set()
        for statement in _statements(ast.parse(path.read_text(encoding="utf-8")), function_level):
            for name in _imported(statement, module, modules):
                parts = name.split(".")
                for i in range(1, len(parts) + 1):
                    target = ".".join(parts[:i])
                    if target in modules and target not in own:
                        edges.add(target)
        graph[module] = edges
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (iterative Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_cycle_finder_finds_a_planted_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_no_module_level_import_cycles():
    graph = _graph()
    assert "merit_core.train.training_run" in graph["merit_core.train"]  # the graph sees the real imports
    assert _cycles(graph) == []


def test_no_import_cycles_counting_imports_inside_functions():
    """A function-level import only postpones a cycle: the modules still need each other."""
    graph = _graph(function_level=True)
    # the graph sees imports inside functions: run_training imports the parallel setup when it runs
    assert "merit_core.train.parallel" in graph["merit_core.train.training_run"]
    assert "merit_core.train.parallel" not in _graph()["merit_core.train.training_run"]
    assert _cycles(graph) == []


def test_every_command_help_stays_light():
    code = textwrap.dedent("""
        import sys
        from click.testing import CliRunner
        from merit_cli.main import COMMANDS, cli
        for args in ([], *([name] for name in COMMANDS)):
            result = CliRunner().invoke(cli, [*args, "--help"])
            assert result.exit_code == 0, (args, result.output)
        heavy = ("torch", "transformers", "lm_eval", "datasets", "matplotlib", "safetensors")
        print(sorted(m for m in heavy if m in sys.modules))
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_optim_imports_neither_models_nor_training():
    """merit_core.optim knows nothing of models or training: the lr table takes the model's name and
    width from its caller (merit_core.train.config.lr_default)."""
    graph = _graph(function_level=True)
    forbidden = ("merit_core.models", "merit_core.train", "merit_core.compare", "merit_core.diagnostics")
    outside = {
        (module, target)
        for module, targets in graph.items()
        if module.startswith("merit_core.optim")
        for target in targets
        if target.startswith(forbidden)
    }
    assert outside == set()
