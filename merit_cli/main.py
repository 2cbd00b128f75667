"""The `merit` click group: subcommands load lazily; MeritError becomes one red line and exit 2.

Exit codes: 0 done, 2 a user error (one line) or a usage error (one line), 130 interrupted by
Ctrl-C, 143 stopped by SIGTERM / SIGUSR1 after a checkpoint (merit_core.errors.RunInterrupted).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from typing import NoReturn

import click

from merit_core.errors import MeritError, one_line, os_error_line
from merit_core.version import __version__

# name -> "module:attribute"; a command's module (and torch) is imported only when it runs.
COMMANDS: dict[str, str] = {
    "train": "merit_cli.train_cmd:train",
    "prepare": "merit_cli.prepare_cmd:prepare",
    "inspect": "merit_cli.inspect_cmd:inspect_cmd",
    "eval": "merit_cli.eval_cmd:eval_cmd",
    "compare": "merit_cli.compare_cmd:compare",
    "check": "merit_cli.check_cmd:check",
}

HELP_SUMMARIES: dict[str, str] = {
    "train": "Pretrain a language model (GPT-2, Llama, Qwen, ...) with MERIT or a baseline optimizer.",
    "prepare": "Tokenize a corpus into memmapped train/val token files.",
    "inspect": "Max-norm, attention-logit and Hessian statistics of checkpoints.",
    "eval": "Zero-shot LAMBADA / WikiText / SuperGLUE through lm-evaluation-harness.",
    "compare": "Run the paper's optimizer x batch-size comparison and report it.",
    "check": "Prove MERIT on this device: every backend against a float64 reference step.",
}


EXIT_INTERRUPTED = 130


def fail(message: str, code: int = 2) -> NoReturn:
    """Print one red error line to stderr and exit with `code` (2: a user error)."""
    from rich.console import Console

    from merit_cli.render import shown

    message = one_line(message)  # one line, whatever the message held, a huge echoed value cut short
    Console(stderr=True, highlight=False).print(f"[bold red]error:[/] {shown(message)}", soft_wrap=True)
    sys.exit(code)


def stopped(message: str, code: int) -> NoReturn:
    """Print one yellow line (training stopped on a signal, after saving) and exit with `code`.

    The message says it all ('stopped by SIGINT after step 5: ...'), so no prefix repeats it."""
    from rich.console import Console

    from merit_cli.render import shown

    Console(stderr=True, highlight=False).print(f"[bold yellow]{shown(message)}[/]", soft_wrap=True)
    sys.exit(code)


class LazyGroup(click.Group):
    """A group whose subcommands are imported on first use, and whose errors are one line."""

    def list_commands(self, ctx):
        return [name for name in COMMANDS if self._available(name)]

    @staticmethod
    def _available(name: str) -> bool:
        module = COMMANDS[name].split(":")[0]
        return importlib.util.find_spec(module) is not None

    def get_command(self, ctx, name):
        if name not in COMMANDS or not self._available(name):
            return None
        from merit_cli.options import fill_metavars

        module_name, attr = COMMANDS[name].split(":")
        return fill_metavars(getattr(importlib.import_module(module_name), attr))

    def format_commands(self, ctx, formatter):
        rows = [(name, HELP_SUMMARIES.get(name, "")) for name in self.list_commands(ctx)]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)

    def invoke(self, ctx):
        from merit_core.errors import RunInterrupted

        try:
            return super().invoke(ctx)
        except MeritError as exc:
            fail(str(exc))
        except RunInterrupted as exc:
            stopped(str(exc), exc.exit_code)
        except KeyboardInterrupt:
            fail("interrupted", EXIT_INTERRUPTED)
        except OSError as exc:  # a path no earlier check caught: too long, read-only, a file on the way, ...
            fail(os_error_line(exc))
        except RecursionError:
            fail("an input is nested too deeply (a TOML value, a --set value or a JSON file thousands of levels deep)")

    def main(self, *args, **kwargs):
        """click's usage errors as one line (the usage block is what --help is for)."""
        kwargs.setdefault("standalone_mode", True)
        if not kwargs["standalone_mode"]:
            return super().main(*args, **kwargs)
        try:
            code = super().main(*args, **{**kwargs, "standalone_mode": False})
        except click.exceptions.Exit as exc:
            sys.exit(exc.exit_code)
        except click.Abort:
            fail("interrupted", EXIT_INTERRUPTED)
        except getattr(click.exceptions, "NoArgsIsHelpError", ()) as exc:  # bare `merit`: the help text
            click.echo(exc.format_message())
            sys.exit(exc.exit_code)
        except click.UsageError as exc:
            where = f"merit {exc.ctx.info_name}: " if exc.ctx is not None and exc.ctx.parent is not None else ""
            fail(f"{where}{exc.format_message()} (see --help)", exc.exit_code)
        except click.ClickException as exc:
            fail(exc.format_message(), exc.exit_code)
        sys.exit(code if isinstance(code, int) else 0)  # what standalone click does (--version gives 0)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="merit")
def cli():
    """merit: MERIT large-batch optimizer and language-model pretraining tools.

    \b
    Examples:
      merit train --steps 5 --out runs/first
      merit inspect runs/first
      merit eval runs/first --tasks builtin
      merit compare --quick
    Each command's --help has more.
    """
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
