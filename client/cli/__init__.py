"""``ptcctl``, the command line: :mod:`ptcfs.client.cli.app` parses and
dispatches; each other module of this package is one family of subcommands,
registered in :data:`ptcfs.client.cli.app.MODULES`."""

from ptcfs.client.cli.app import build_parser, emit_json, main, register

__all__ = ["build_parser", "emit_json", "main", "register"]
