"""``ptcctl``: the command line of ptcfs.

Each subcommand lives in its own module and registers itself with
:func:`register` (its parser and the function that runs it). Errors that
ptcfs raises on purpose are printed as one line; nothing prints a traceback
unless ``--debug`` is given. Exit statuses (``ptcfs.errors.EXIT_CODES``): 0
done, 1 the work failed (a host, the store, what the cluster holds), 2 the
command line cannot work (argparse's errors, and :class:`InvalidConfig` or
:class:`BadInput` from the checks at the door), 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from ptcfs import settings
from ptcfs.errors import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, PtcError, exit_code

__all__ = ["main", "register", "emit_json"]

Runner = Callable[[argparse.Namespace], int]
_COMMANDS: list[tuple[str, Callable[[argparse._SubParsersAction], None]]] = []
#: the module of each subcommand (importing it registers the subcommand), in
#: the help's order. A command line imports its subcommand's module only: all
#: of them cost about 0.7 s, most of a short command's time.
MODULES = {
    "plan": "plan", "spec": "plan",
    "job": "cluster", "status": "cluster", "tensor": "cluster",
    "checksum": "cluster", "verify": "cluster", "reconfigure": "cluster",
    "commit": "save", "discard": "save", "mount": "mount", "import": "ckpt", "export": "ckpt",
    "data": "data", "config": "config", "suggest": "suggest",
    "repair": "repair", "keys": "access", "audit": "access",
}


def register(name: str) -> Callable[[Callable[[argparse._SubParsersAction], None]], Any]:
    """Decorator for a function that adds subcommand ``name`` to the parser."""

    def wrap(fn: Callable[[argparse._SubParsersAction], None]) -> Any:
        _COMMANDS.append((name, fn))
        return fn

    return wrap


def emit_json(obj: Any) -> None:
    """Print one JSON object (the ``--json`` output of every command)."""
    json.dump(obj, sys.stdout, indent=None, separators=(",", ":"), sort_keys=False)
    sys.stdout.write("\n")


def one_line(text: str) -> str:
    """``text`` with control characters (a newline in a value the user typed)
    escaped, so that an error stays one line."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii")
                   for c in text)


class _Parser(argparse.ArgumentParser):
    """Usage errors are one line (and exit 2), like every other error."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {one_line(message)} "
                  f"(see {self.prog} --help)\n")


def _modules(argv: list[str] | None) -> list[str]:
    """The modules ``argv`` needs: its subcommand's, or every one (no
    ``argv``, no subcommand, an unknown one, ``--help`` before it)."""
    words = iter(argv or ())
    for w in words:
        if w == "--cluster":
            next(words, None)
        elif not w.startswith("-"):
            return [MODULES[w]] if w in MODULES else list(dict.fromkeys(MODULES.values()))
    return list(dict.fromkeys(MODULES.values()))


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser of ``argv``'s subcommand (of every subcommand without
    ``argv``, or where it names none: see :func:`_modules`)."""
    import importlib

    for mod in _modules(argv):
        importlib.import_module(f"ptcfs.client.cli.{mod}")
    parser = _Parser(
        prog="ptcctl",
        description="Inspect and reconfigure ptcfs parallelizable tensor collections.",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    # global options may stand before the subcommand too (ptcctl --cluster F status)
    parser.add_argument("--cluster", dest="global_cluster", metavar="FILE",
                        help="cluster file (default: $PTC_CLUSTER)")
    parser.add_argument("--json", dest="global_json", action="store_true",
                        help="print one JSON object (commands that have --json)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for _, add in sorted(_COMMANDS, key=lambda c: list(MODULES).index(c[0])):
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``ptcctl``; returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    for name in ("cluster", "json"):
        given = getattr(args, f"global_{name}")
        if given and hasattr(args, name) and not getattr(args, name):
            setattr(args, name, given)
        elif given and not hasattr(args, name):
            parser.error(f"ptcctl {args.command} takes no --{name}")
    try:
        settings.check_all()
        return int(args.run(args))
    except PtcError as e:
        if args.debug:
            raise
        print(f"ptcctl {args.command}: error: {one_line(str(e))}", file=sys.stderr)
        return exit_code(e)
    except MemoryError:
        if args.debug:
            raise
        # said below, once this handler is left: until then its traceback keeps what
        # filled the memory, and printing could fail for want of memory too
    except KeyboardInterrupt:
        print(f"ptcctl {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        return EXIT_OK
    except OSError as e:
        if args.debug:
            raise
        print(f"ptcctl {args.command}: error: {one_line(str(e))}", file=sys.stderr)
        return EXIT_FAILED
    print(f"ptcctl {args.command}: error: not enough memory on this machine for this "
          "command (a smaller model, or another machine)", file=sys.stderr)
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
