"""CLI subcommands: each module exposes `register(subparsers)` and sets `run` on its parser."""
