"""`python -m merit_cli ...` (what torchrun launches)."""

from merit_cli.main import cli

if __name__ == "__main__":
    cli(prog_name="merit")
