"""The package version, kept apart so the CLI can read it without importing torch."""

__version__ = "0.1.0"
