"""`python -m merit_cli ...` (what torchrun launches)."""

from merit_cli.entry import main

if __name__ == "__main__":
    main()
