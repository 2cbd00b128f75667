"""One vocabulary across the commands (README: "One vocabulary"): an option name means the same thing in
every command that has it, read from each command's --help; an output path that cannot be written is
refused at once, before torch (let alone a model) loads; the old spellings still work, with a notice."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from merit_cli.main import COMMANDS, cli
from merit_cli.options import steps_option
from tests.cli_runs import invoke

# What each shared name means: (takes a value, the words its help starts with or holds).
MEANINGS = {
    "--out": (True, "write"),  # -o/--out: where the command writes its results
    "--json": (False, "print"),  # prints JSON (on stdout)
    "--steps": (True, "updates"),  # a number of updates (merit train)
    "--checkpoints": (True, "which step_n checkpoints"),  # a selection of a run's checkpoints
}
WRITERS = ("train", "prepare", "inspect", "eval", "compare")


def _options(command: str) -> dict[str, tuple[bool, str, str]]:
    """--help of `merit COMMAND` -> {long name: (takes a value, short name, help text)}."""
    text = invoke([command, "--help"]).output
    options = text[text.index("Options:") :]
    found = {}
    for match in re.finditer(
        r"^  (-\w, )?(--[\w-]+)(?:/--[\w-]+)?( [^ \n][^ \n]*)?\s+(.*(?:\n {10,}.*)*)", options, re.M
    ):
        short, name, metavar, help_text = match.groups()
        found[name] = (metavar is not None, (short or "").strip(", "), " ".join(help_text.split()).lower())
    return found


def test_every_commands_help_gives_a_shared_name_one_meaning():
    helps = {name: _options(name) for name in COMMANDS}
    for name, (takes_value, words) in MEANINGS.items():
        having = [c for c in helps if name in helps[c]]
        assert having, name
        for command in having:
            value, _short, text = helps[command][name]
            assert value == takes_value, (command, name, helps[command][name])
            assert words in text, (command, name, text)
    assert [c for c in helps if "--out" in helps[c]] == list(WRITERS)
    assert all(helps[c]["--out"][1] == "-o" for c in WRITERS)  # -o everywhere, as pip and lm-eval's users type it
    assert [c for c in helps if "--steps" in helps[c]] == ["train"]  # --steps is hidden where it is an old spelling
    assert sorted(c for c in helps if "--checkpoints" in helps[c]) == ["eval", "inspect"]
    assert sorted(c for c in helps if "--json" in helps[c]) == ["check", "inspect", "prepare"]
    shared = {n for c in helps for n in helps[c] if sum(n in helps[d] for d in helps) > 1}
    for name in shared:  # any other shared name (--device, --seed, --wide, ...): a value everywhere or nowhere
        assert len({helps[c][name][0] for c in helps if name in helps[c]}) == 1, name


NO_TORCH = """
import sys
from merit_cli.main import cli
try:
    cli(sys.argv[1:], prog_name="merit")
finally:
    print("torch loaded" if "torch" in sys.modules else "torch not loaded", file=sys.stderr)
"""


@pytest.mark.parametrize(
    "args",
    [
        ["train", "--steps", "1", "-o", "/proc/merit-run"],
        ["prepare", "--builtin", "-o", "/proc/merit-data"],
        ["inspect", "{ckpt}", "-o", "/proc/merit-report.json"],
        ["eval", "{ckpt}", "--tasks", "builtin", "-o", "/proc/merit-scores.json"],
        ["compare", "--quick", "-o", "/proc/merit-compare"],
    ],
    ids=lambda args: args[0],
)
def test_an_unwritable_output_is_refused_before_any_model(args, tmp_path):
    """/proc takes no new file, whoever asks (root included, whom os.access would let through)."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "model.safetensors").write_bytes(b"")
    argv = [str(ckpt) if a == "{ckpt}" else a for a in args]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", NO_TORCH, *argv], capture_output=True, text=True, env=env, timeout=60)
    seconds = time.monotonic() - start
    lines = done.stderr.splitlines()
    assert done.returncode == 2, done.stderr
    assert lines[-1] == "torch not loaded" and len(lines) == 2, done.stderr  # one error line, and no model built
    assert "/proc/merit-" in lines[0] and "cannot" in lines[0], lines[0]
    assert seconds < 2, (seconds, argv)


def test_old_spellings_still_work_with_a_one_line_notice(tmp_path, capsys):
    from merit_cli.eval_cmd import eval_cmd
    from merit_cli.inspect_cmd import inspect_cmd
    from merit_core.checkpoint import parse_selection

    report = tmp_path / "r.json"
    ctx = inspect_cmd.make_context("inspect", [str(tmp_path), "--json", str(report), "--steps", "latest"])
    assert ctx.params["out"] == str(report) and not ctx.params["as_json"]
    assert ctx.params["selection"] == parse_selection("latest")
    notices = capsys.readouterr().err.splitlines()
    assert [n.split(" is now ")[0] for n in notices] == ["note: --json PATH", "note: --steps"], notices
    ctx = inspect_cmd.make_context("inspect", ["--json", str(tmp_path)])  # a folder after --json: a PATH, printed
    assert ctx.params["as_json"] and ctx.params["paths"] == (tmp_path,) and ctx.params["out"] is None
    assert ctx.params["selection"] == parse_selection("all")  # inspect's default
    with eval_cmd.make_context("eval", ["x", "--output", "s.json"]) as ctx:
        assert ctx.meta["merit.old_out"] == "s.json"
    assert (
        capsys.readouterr().err
        == "note: --output is now -o/--out; --output still works in this release and will be removed\n"
    )


def test_checkpoints_given_twice_is_one_line():
    command = steps_option("latest")(click.Command("x", callback=lambda selection: None))
    with pytest.raises(Exception, match="give --checkpoints once"):
        command.make_context("x", ["--checkpoints", "all", "--steps", "latest"])


@pytest.fixture(scope="module")
def gpt2_tiny(tmp_path_factory) -> Path:
    """An untrained gpt2-tiny checkpoint (merit's named model, 4 layers), saved as merit train saves one."""
    from transformers import AutoModelForCausalLM

    from merit_core.models import model_config

    folder = tmp_path_factory.mktemp("gpt2-tiny")
    AutoModelForCausalLM.from_config(model_config("gpt2-tiny")).save_pretrained(folder)
    return folder


def test_inspect_of_gpt2_tiny_is_short_by_default(gpt2_tiny):
    short = CliRunner().invoke(cli, ["inspect", str(gpt2_tiny), "--seq-len", "32"])
    assert short.exit_code == 0, short.output
    lines = short.output.splitlines()
    assert len(lines) <= 40, short.output
    table = [l for l in lines if l[:1] in "┏┃┡│└"]
    assert table and all(len(l) <= 100 for l in table), short.output  # the summary fits 100 columns
    assert "logit bound, spectral bound: upper bounds" in short.output  # the two bounds explained where shown
    assert "W_Q / W_K norms" not in short.output  # the per-layer tables wait for --layers
    detailed = CliRunner().invoke(cli, ["inspect", str(gpt2_tiny), "--seq-len", "32", "--layers"])
    text = " ".join(detailed.output.split())  # titles fold at the console's width
    assert "W_Q / W_K norms" in text and "every 2-D weight" in text
    printed = CliRunner().invoke(cli, ["inspect", str(gpt2_tiny), "--seq-len", "32", "--json", "--no-logits"])
    assert printed.output.lstrip().startswith("{") and '"checkpoints"' in printed.output


def test_a_one_row_table_is_never_split():
    from rich.console import Console
    from rich.table import Table

    from merit_cli.render import print_table

    table = Table(title="scores")
    for n in range(12):
        table.add_column(f"a long column name {n}", justify="right")
    table.add_row(*(f"{n}.5" for n in range(12)))
    console = Console(width=60, record=True)
    print_table(console, table)
    text = console.export_text()
    assert "(1/" not in text and "a long column name 11" in text and "11.5" in text
    assert all(len(line) <= 60 for line in text.splitlines())


def test_a_prepared_token_file_is_named_for_what_it_is(tmp_path):
    (tmp_path / "meta.json").write_text("{}")
    (tmp_path / "train.bin").write_bytes(b"\0" * 8)
    for command in (["inspect"], ["eval", "--tasks", "builtin"]):
        result = (
            invoke([*command, str(tmp_path / "train.bin")])
            if command == ["inspect"]
            else invoke(["eval", str(tmp_path / "train.bin"), "--tasks", "builtin"])
        )
        assert result.exit_code == 2
        assert "token file of data prepared by merit prepare, not a checkpoint" in result.output, result.output


def test_a_missing_checkpoint_has_one_message_in_every_command(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    for args in (["inspect", "runs/nope"], ["eval", "runs/nope", "--tasks", "builtin"]):
        result = invoke(args)
        assert result.exit_code == 2 and result.output == "error: checkpoint not found: runs/nope\n", result.output
