"""The `merit` command line: thin click commands over merit_core."""
