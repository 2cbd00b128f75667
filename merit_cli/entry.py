"""The `merit` script: checks that the [cli] extra is installed, then runs the click group.

Nothing here imports a third-party package, so `pip install merit-optim` (torch alone) still
gets a one-line answer from `merit` instead of a traceback.
"""

from __future__ import annotations

import sys


def main() -> None:
    from merit_core.extras import cli_install_hint, missing_cli_modules

    if sys.argv[1:] == ["--version"]:  # answered without the extra: it is how one checks what is installed
        from merit_core.version import __version__

        sys.stdout.write(f"merit, version {__version__}\n")
        sys.exit(0)
    missing = missing_cli_modules()
    if missing:
        sys.stderr.write(f"error: {cli_install_hint(missing)}\n")
        sys.exit(2)
    from merit_cli.main import cli

    cli(prog_name="merit")
