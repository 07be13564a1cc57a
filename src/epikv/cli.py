"""The `epikv` command line. Each subcommand lives in epikv/commands/<name>.py with `register(subparsers)`."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import warnings

from .errors import ContextWarning, EpiKVError

# Subcommand modules, in the order `epikv --help` lists them.
COMMANDS = ["generate", "policies", "trace", "eval", "report", "retention", "bench", "anatomy", "serve", "calibrate"]
QUICK = {"policies"}  # commands that never load a model: torch and transformers stay unimported


class Parser(argparse.ArgumentParser):
    """argparse that reports a bad argument in one line (no usage dump) and exits 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = Parser(prog="epikv", description="Attention-free KV cache eviction for long reasoning traces (EPIKV).")
    parser.add_argument("--version", action="version", version=f"epikv {__version__}",
                        help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    sub.required = True
    for name in COMMANDS:
        importlib.import_module(f".commands.{name}", __package__).register(sub)
    return parser


def _one_line_context_warnings(command: str) -> None:
    """Inside catch_warnings: each kind of ContextWarning once, as one line on stderr (not Python's two-line form)."""
    seen: set[str] = set()
    show = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if not issubclass(category, ContextWarning):
            return show(message, category, filename, lineno, file, line)
        kind = getattr(message, "kind", str(message))
        if kind not in seen:
            seen.add(kind)
            print(f"epikv {command}: warning: {message}", file=sys.stderr)

    warnings.simplefilter("always", ContextWarning)
    warnings.showwarning = showwarning


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = build_parser()
    if not (sys.argv[1:] if argv is None else argv):
        # bare `epikv`: the help on stdout (readable through a pager), and exit 2 as argparse does for a missing
        # command, so a script that forgot its command still fails
        parser.print_help()
        return 2
    args = parser.parse_args(argv)  # --help and bad arguments end here, before transformers is imported
    if args.command not in QUICK:
        from transformers.utils import logging as hf_logging

        # The CLI speaks for itself: no transformers progress bars or advisory warnings on stderr.
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            _one_line_context_warnings(args.command)
            return int(args.run(args) or 0)
    except EpiKVError as e:
        print(f"epikv {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"epikv {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `epikv policies | head`: the reader left; no error, and no second one at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except (OSError, RuntimeError, ValueError) as e:  # e.g. out of memory, unreadable file
        if os.environ.get("EPIKV_DEBUG"):
            raise
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"epikv {args.command}: error: {type(e).__name__}: {msg} (set EPIKV_DEBUG=1 for a traceback)",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
