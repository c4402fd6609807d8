"""Command-line subcommands of ``python -m embtables`` (one module each)."""
