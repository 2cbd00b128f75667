"""The `merit` script: checks that the [cli] extra is installed, then runs the click group.

Nothing here imports a third-party package, so `pip install merit-optim` (torch alone) still
gets a one-line answer from `merit` instead of a traceback.
"""

from __future__ import annotations

import os
import sys


def _usable_stdio() -> None:
    """A closed stdout or stderr (`merit ... >&-`) reads as /dev/null rather than failing every print,
    and a text that the output's encoding cannot hold (PYTHONIOENCODING=ascii) is escaped, not fatal."""
    import os

    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is None:
            setattr(sys, name, open(os.devnull, "w", encoding="utf-8"))  # noqa: SIM115 - lives as long as the process
        elif hasattr(stream, "reconfigure"):
            try:
                stream.reconfigure(errors="backslashreplace")
            except (OSError, ValueError):
                pass


def main() -> None:
    from merit_core.extras import cli_install_hint, missing_cli_modules

    _usable_stdio()
    if sys.argv[1:] == ["--version"]:  # answered without the extra: it is how one checks what is installed
        from merit_core.version import __version__

        try:
            sys.stdout.write(f"merit, version {__version__}\n")
            sys.stdout.flush()
        except OSError:  # the reader went away (`merit --version | true`): nothing more to say
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())  # so that the flush at exit cannot fail either
        sys.exit(0)
    missing = missing_cli_modules()
    if missing:
        sys.stderr.write(f"error: {cli_install_hint(missing)}\n")
        sys.exit(2)
    from merit_cli.main import cli

    cli(prog_name="merit")
