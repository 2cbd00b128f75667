"""Import hygiene: no import cycles in the packages (at module level, counting the imports made
inside functions, and counting those made only for type checking), no loop between merit_core's
folders, imports of merit's own modules inside functions of merit_core only where listed with a
reason, every command's --help stays light, diagnostics / evaluation / checkpoint never import
train, the CLI uses merit_core's public names only, in train/ only the run folder's owner writes,
and the instability watcher neither imports nor names the training run."""

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


def _statements(
    tree: ast.Module, function_level: bool, type_checking: bool = False
) -> list[ast.Import | ast.ImportFrom]:
    """The import statements of a module outside `if TYPE_CHECKING:` blocks (inside them too with
    `type_checking`): the top-level ones (and those in a top-level try), or with `function_level`
    every one, in functions and methods too."""
    skipped: set[int] = set()
    nodes = list(ast.walk(tree)) if function_level else list(tree.body)
    for node in nodes:
        if not type_checking and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
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


def _graph(function_level: bool = False, type_checking: bool = False) -> dict[str, set[str]]:
    """module -> the project modules its import runs first (top-level imports, outside TYPE_CHECKING);
    with `function_level`, also the modules its functions import when they run; with
    `type_checking`, also those imported for the type checker alone.

    Importing a.b.c also runs the packages a and a.b, except the module's own packages (already
    running when one of their modules is imported)."""
    modules = _modules()
    graph = {}
    for module, path in modules.items():
        own = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 2)}
        edges = set()
        for statement in _statements(ast.parse(path.read_text(encoding="utf-8")), function_level, type_checking):
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
    assert "merit_core.train.config" in graph["merit_core.train"]  # the graph sees the real imports
    assert _cycles(graph) == []


def test_no_import_cycles_counting_imports_inside_functions():
    """A function-level import only postpones a cycle: the modules still need each other."""
    graph = _graph(function_level=True)
    # the graph sees imports inside functions: merit_core imports the optimizers when asked for them
    assert "merit_core.optim" in graph["merit_core"]
    assert "merit_core.optim" not in _graph()["merit_core"]
    assert _cycles(graph) == []


def test_no_import_cycles_counting_imports_for_the_type_checker():
    """An import under `if TYPE_CHECKING:` is a dependency too: two modules that name each other's
    types cannot be read, changed or tested one without the other."""
    graph = _graph(function_level=True, type_checking=True)
    assert _cycles(graph) == []
    planted = ast.parse(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from merit_core.train import trainer\n"
    )
    assert len(_statements(planted, True, type_checking=True)) == 2 and len(_statements(planted, True)) == 1


def test_every_command_help_stays_light():
    code = textwrap.dedent("""
        import sys
        from click.testing import CliRunner
        from merit_cli.main import COMMANDS, cli
        for args in ([], *([name] for name in COMMANDS)):
            result = CliRunner().invoke(cli, [*args, "--help"])
            assert result.exit_code == 0, (args, result.output)
        heavy = ("torch", "transformers", "lm_eval", "datasets", "matplotlib", "safetensors", "numpy")
        print(sorted(m for m in heavy if m in sys.modules))
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# What merit_core/optim (the slim install: torch alone) may import from the rest of merit_core: leaf
# modules that import nothing of merit's but errors. The lr table takes a model's name and width from
# its caller (merit_core.train.config.resolve), so nothing of optim reads models or training; the
# built-in optimizer names are a leaf module that `merit train` reads before torch loads.
OPTIM_MAY_IMPORT = {
    "merit_core",
    "merit_core.errors",
    "merit_core.extras",
    "merit_core.optimizer_names",
    "merit_core.paths",
    "merit_core.values",
}


def _optim_modules(graph: dict[str, set[str]]) -> list[str]:
    return [m for m in graph if m.split(".")[:2] == ["merit_core", "optim"]]


def test_optim_imports_nothing_of_merit_but_itself_and_leaf_modules():
    graph = _graph(function_level=True)
    assert "merit_core.optim" in graph["merit_core"]  # the graph sees function-level imports
    for module in _optim_modules(graph):
        outside = {t for t in graph[module] if t.split(".")[:2] != ["merit_core", "optim"]}
        assert outside <= OPTIM_MAY_IMPORT, (module, sorted(outside - OPTIM_MAY_IMPORT))
    for leaf in OPTIM_MAY_IMPORT - {"merit_core", "merit_core.errors"}:
        assert graph[leaf] <= {"merit_core.errors"}, (leaf, graph[leaf])


def test_optim_imports_merits_modules_at_the_top_of_its_modules():
    """Inside merit_core/optim every import of merit's own modules is at module level, where a reader
    and the graph see it (the Triton backend, which imports triton, is loaded by name when chosen)."""
    top, everywhere = _graph(), _graph(function_level=True)
    hidden = {m: sorted(everywhere[m] - top[m]) for m in _optim_modules(everywhere) if everywhere[m] - top[m]}
    assert hidden == {}


def _folder(module: str, modules: dict[str, Path]) -> str:
    """The folder (package) a module lives in: merit_core.compare.grid -> merit_core.compare; a
    module directly in merit_core (durable_writes.py, metrics.py, ...) is a node of its own."""
    parts = module.split(".")
    package = parts if modules[module].name == "__init__.py" else parts[:-1]
    return module if len(package) == 1 else ".".join(package)


def _folder_graph(graph: dict[str, set[str]], depth: int | None = None) -> dict[str, set[str]]:
    """folder -> the folders its modules import (function-level imports included): merit_core's own
    folders only, cut at `depth` dotted parts (2: merit_core.optim for merit_core.optim.merit.triton)."""
    modules = _modules()
    own = [m for m in graph if m.startswith("merit_core.")]

    def node(module: str) -> str:
        folder = _folder(module, modules)
        return ".".join(folder.split(".")[:depth]) if depth and folder.count(".") >= depth else folder

    folders: dict[str, set[str]] = {node(m): set() for m in own}
    for module in own:
        for target in graph[module]:
            if target.startswith("merit_core.") and node(target) != node(module):
                folders[node(module)].add(node(target))
    return folders


def test_no_loop_between_merit_core_folders():
    """A folder that imports another that imports it back (diagnostics reading train/'s metrics
    while train/ probes attention with diagnostics/) has no layer of its own: neither can be read,
    moved or installed without the other. Imports inside functions count."""
    graph = _graph(function_level=True)
    for depth in (2, None):  # merit_core's top folders, then every sub-folder
        folders = _folder_graph(graph, depth)
        assert "merit_core.optim" in folders["merit_core.train"]  # the graph sees the folders' imports
        assert _cycles(folders) == [], depth
    planted = {**graph, "merit_core.checkpoint.runs": graph["merit_core.checkpoint.runs"] | {"merit_core.train.config"}}
    assert _cycles(_folder_graph(planted, 2))  # train/ imports checkpoint/: checkpoint/ importing train/ is a loop


# The imports of merit's own modules that stay inside functions of merit_core: where the importing
# module is imported on a light path (`merit --help` and every command's --help must not import torch,
# transformers or numpy; see test_every_command_help_stays_light), and the imported one would pull
# that in. Keys: (module, the merit module its function imports). Each import has its reason in a
# comment beside it too.
DEFERRED = {
    ("merit_core", "merit_core.optim"): "torch: `merit --help` imports merit_core; MERIT loads when asked for",
    ("merit_core.evaluation.builtin_tasks", "merit_core.data.builtin"): "numpy: at `merit eval --help`",
    ("merit_core.integrations", "merit_core.models.attention_probe"): "transformers: importing the integrations "
    "package (the Lightning callback) imports neither transformers nor lightning",
}
# At most this many such import statements (a ratchet: lower it as imports move to the top).
MAX_DEFERRED = 3


def _deferred() -> list[tuple[str, str, Path, int]]:
    """(module, imported merit module, file, line) of every import of merit's own modules made inside
    a function (or any other block below the module's top level) of merit_core."""
    modules = _modules()
    found = []
    for module, path in modules.items():
        if not module.startswith("merit_core"):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        top = {id(n) for n in _statements(tree, function_level=False)}
        for statement in _statements(tree, function_level=True):
            if id(statement) in top:
                continue
            for target in _imported(statement, module, modules):
                if target.split(".")[0] in PACKAGES and target != module:
                    found.append((module, target, path, statement.lineno))
    return found


def _has_reason(lines: list[str], lineno: int) -> bool:
    """A comment on the import's line, or above the run of import lines it belongs to."""
    if "#" in lines[lineno - 1]:
        return True
    above = lineno - 2
    while above >= 0 and lines[above].strip().startswith(("from ", "import ")):
        if "#" in lines[above]:
            return True
        above -= 1
    return above >= 0 and lines[above].strip().startswith("#")


def test_imports_inside_functions_of_merit_core_are_listed_with_a_reason():
    deferred = _deferred()
    assert ("merit_core", "merit_core.optim") in {(m, t) for m, t, _, _ in deferred}
    unlisted = sorted({(m, t) for m, t, _, _ in deferred} - set(DEFERRED))
    assert unlisted == [], "move these imports to the top of their module, or list them with why they wait"
    stale = sorted(set(DEFERRED) - {(m, t) for m, t, _, _ in deferred})
    assert stale == [], "listed but no longer inside a function: drop them from DEFERRED"
    statements = {(path, line) for _, _, path, line in deferred}
    assert len(statements) <= MAX_DEFERRED, len(statements)
    texts = {path: path.read_text(encoding="utf-8").splitlines() for path, _ in statements}
    silent = sorted(
        f"{path.relative_to(ROOT)}:{line}" for path, line in statements if not _has_reason(texts[path], line)
    )
    assert silent == [], "say beside each why it waits"


# Folders that read what training wrote only through merit_core.checkpoint (and the neutral
# modules: schedule, metrics), never through train/: inspecting or scoring a checkpoint needs
# neither the trainer nor its config machinery.
NOT_THROUGH_TRAIN = ("merit_core.diagnostics", "merit_core.evaluation", "merit_core.checkpoint")


def test_diagnostics_evaluation_and_checkpoint_do_not_import_train():
    folders = _folder_graph(_graph(function_level=True), 2)
    assert "merit_core.checkpoint" in folders["merit_core.diagnostics"]  # the graph sees what they import
    assert "merit_core.checkpoint" in folders["merit_core.evaluation"]
    for folder in NOT_THROUGH_TRAIN:
        assert "merit_core.train" not in folders[folder], folder
    assert (
        "merit_core.train"
        in _folder_graph({**_graph(), "merit_core.diagnostics.inspect_report": {"merit_core.train.config"}}, 2)[
            "merit_core.diagnostics"
        ]
    )  # a planted import is seen


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))  # __version__ is public


def _private_reaches(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, what) for each import of merit_core that names a private module or name: a part or an
    imported name that starts with an underscore (dunder names such as __version__ are public)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("merit_core"):
            parts = (node.module or "").split(".")
            names = [alias.name for alias in node.names]
            found += [(node.lineno, f"{node.module}: {n}") for n in [*parts, *names] if _private(n)]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("merit_core") and any(_private(p) for p in alias.name.split(".")):
                    found.append((node.lineno, alias.name))
    return found


def test_private_reaches_are_found_in_a_planted_module():
    planted = ast.parse(
        "from merit_core.train.trainer import _clip\nimport merit_core._x\nfrom merit_core import runs\n"
    )
    assert [what for _, what in _private_reaches(planted)] == ["merit_core.train.trainer: _clip", "merit_core._x"]


def test_the_cli_reaches_merit_core_through_its_public_names_only():
    """merit_cli imports what merit_core's modules offer, never a private module or name of theirs
    (`_helper`): a private name is free to change with the module that owns it."""
    found = []
    for path in sorted((ROOT / "merit_cli").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        found += [f"{path.relative_to(ROOT)}:{line}: {what}" for line, what in _private_reaches(tree)]
    assert found == []


def _imported_modules(path: Path) -> set[str]:
    """Every module a file imports (stdlib and third-party too), anywhere in it."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def test_a_run_folder_is_read_through_merit_core_checkpoint():
    """compare reaches run folders through the checkpoint package's resolver and readers, never the
    layout module (merit_core.checkpoint.runs: step folders, "latest"); a run's config.toml is read by
    merit_core.checkpoint.run_config alone, and a TOML file is loaded in one place (file_reading.read_toml_file;
    config_reading.py's tomllib parses --set values, and its read_toml the train and compare config files)."""
    modules = _modules()
    imports = {name: _imported_modules(path) for name, path in modules.items()}
    compare = sorted(m for m in modules if m.startswith("merit_core.compare"))
    assert "merit_core.compare.runner" in compare
    reaching = [m for m in compare if any(i.startswith("merit_core.checkpoint.runs") for i in imports[m])]
    assert reaching == []
    assert sorted(m for m in modules if "tomllib" in imports[m]) == [
        "merit_core.config_reading",
        "merit_core.file_reading",
    ]
    loading = sorted(m for m in modules if "merit_core.file_reading.read_toml_file" in imports[m])
    assert loading == ["merit_core.checkpoint.run_config", "merit_core.config_reading"]
    spec_readers = sorted(m for m in modules if "merit_core.config_reading.read_toml" in imports[m])
    assert spec_readers == ["merit_core.compare.spec"]  # a compare spec; config_reading.py reads train configs
    planted = {
        **imports,
        "merit_core.compare.runner": imports["merit_core.compare.runner"] | {"merit_core.checkpoint.runs"},
    }
    assert [m for m in compare if any(i.startswith("merit_core.checkpoint.runs") for i in planted[m])]


# In merit_core/train/ the run folder is written by its owner alone (merit_core.train.run_folder):
# config.toml, metrics.jsonl, curves.png, the marker and lock, staging, checkpoints and pruning.
RUN_FOLDER_OWNER = "merit_core.train.run_folder"
# Calls that write or remove files: merit's own writers (by name, whatever they are called on) ...
WRITERS = {
    "save_checkpoint",
    "prune_checkpoints",
    "write_trainer_state",
    "publish_folder",
    "begin_staging",
    "set_aside_later_checkpoints",
    "remove_stale_staging",
    "recover_staging",
    "mark_run",
    "lock_run",
    "save_config",
    "atomic_write",
    "atomic_write_json",
    "create_new",
    "MetricsLog",
    "truncate_after",
    "save_pretrained",
    "savefig",
    "write_text",
    "write_bytes",
    "rmtree",
    "copyfile",
}
# ... and the standard library's and torch's, by their module: os.replace, torch.save, ...
QUALIFIED_WRITERS = {
    "os": {"replace", "rename", "remove", "unlink", "rmdir", "mkdir", "makedirs", "open", "write"},
    "shutil": {"rmtree", "copyfile", "copy", "copy2", "copytree", "move"},
    "torch": {"save"},
}
# (module, call): why a train/ module other than the owner may make it.
WRITES_ALLOWED = {
    ("merit_core.train.fsdp", "dcp.save"): "every process writes its optimizer shards into the staged "
    "checkpoint folder that the owner made and hands it (RunFolder.save -> Trainer.state_dict)",
    ("merit_core.train.plots", "fig.savefig"): "into memory (io.BytesIO): the owner writes curves.png (RunFolder.plot)",
}


def _writes(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, call) for each call in `tree` that writes or removes a file (see WRITERS), and each
    `open(...)` with a mode that writes."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        owner = func.value.id if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) else None
        if name == "open" and owner is None:
            mode = (
                node.args[1] if len(node.args) > 1 else next((k.value for k in node.keywords if k.arg == "mode"), None)
            )
            if isinstance(mode, ast.Constant) and isinstance(mode.value, str) and set(mode.value) & set("wax+"):
                found.append((node.lineno, "open"))
        elif name in WRITERS or (owner is not None and name in QUALIFIED_WRITERS.get(owner, ())):
            found.append((node.lineno, f"{owner}.{name}" if owner else name))
        elif owner is not None and name == "save":
            found.append((node.lineno, f"{owner}.save"))  # torch.save under another name, dcp.save
    return found


def test_write_calls_are_found_in_a_planted_module():
    planted = ast.parse(
        "import os, torch\nfrom merit_core import durable_writes\n"
        "durable_writes.atomic_write(p, b'')\ntorch.save({}, p)\nos.replace(a, b)\nopen(p, 'w')\nopen(p)\n"
        "model.save_pretrained(p)\n'x'.replace('a', 'b')\nlog = MetricsLog(run)\n"
    )
    assert _writes(planted) == [
        (3, "durable_writes.atomic_write"),
        (4, "torch.save"),
        (5, "os.replace"),
        (6, "open"),
        (8, "model.save_pretrained"),
        (10, "MetricsLog"),
    ]


def test_only_the_run_folder_owner_writes_in_train():
    """Every file of a run folder is written by one object (merit_core.train.run_folder.RunFolder),
    which alone knows when it may write (the lock held, the first write done, the main process):
    no other module of merit_core/train/ writes, removes or stages a file."""
    modules = _modules()
    train = sorted(m for m in modules if m.startswith("merit_core.train.") and m != RUN_FOLDER_OWNER)
    assert "merit_core.train.training_run" in train and "merit_core.train.run_watch" in train
    found = {
        (m, call): line for m in train for line, call in _writes(ast.parse(modules[m].read_text(encoding="utf-8")))
    }
    assert sorted(set(found) - set(WRITES_ALLOWED)) == []
    assert sorted(set(WRITES_ALLOWED) - set(found)) == [], "listed but no longer made: drop them from WRITES_ALLOWED"
    owner = _writes(ast.parse(modules[RUN_FOLDER_OWNER].read_text(encoding="utf-8")))
    assert {"save_checkpoint", "prune_checkpoints", "save_config"} <= {call.split(".")[-1] for _, call in owner}


def _names(tree: ast.Module) -> set[str]:
    """Every identifier, attribute and string constant of `tree` (a string annotation names a type too)."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            found.update(node.value.replace(".", " ").replace("[", " ").replace("]", " ").split())
        elif isinstance(node, ast.alias):
            found.update(node.name.split("."))
    return found


def test_the_watcher_neither_imports_nor_names_the_training_run():
    """The watcher decides (warn, stop, rewind) and the run acts on the decision: the watcher's module
    imports neither the training run nor the run folder's owner, even for the type checker, and
    never names the TrainingRun class (it cannot reach into the run's state)."""
    watcher = "merit_core.train.run_watch"
    graph = _graph(function_level=True, type_checking=True)
    reached, todo = set(), [watcher]
    while todo:  # everything the watcher's imports import, transitively
        for target in graph[todo.pop()] - reached:
            reached.add(target)
            todo.append(target)
    assert "merit_core.train.watch_detector" in reached  # the graph sees what the watcher imports
    assert {"merit_core.train.training_run", RUN_FOLDER_OWNER} & reached == set()
    assert "TrainingRun" not in _names(ast.parse(_modules()[watcher].read_text(encoding="utf-8")))
    assert "TrainingRun" in _names(ast.parse('def f(run: "TrainingRun"): pass'))  # a string annotation is seen
