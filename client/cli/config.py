"""``ptcctl config``: every setting's effective value and where it comes from."""

from __future__ import annotations

import argparse
from typing import Any

from ptcfs import settings
from ptcfs.client.cli.app import emit_json, register

__all__: list[str] = []


@register("config")
def _add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "config", help="show the effective PTC_* settings",
        description="Show every PTC_* setting: its effective value, whether it comes from the "
                    "environment or is the default, its unit and what it sets.")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    rows: dict[str, dict[str, Any]] = {}
    for name, s in settings.SETTINGS.items():
        rows[name] = {"value": settings.get(name), "source": settings.source(name),
                      "default": s.default_text(), "unit": s.unit, "doc": s.doc}
    if args.json:
        emit_json({"settings": rows})
        return 0
    width = max(map(len, rows))
    for name, r in rows.items():
        value = "unset" if r["value"] is None else r["value"]
        print(f"{name:<{width}}  {value!s:<14} {r['source']:<11}  {r['doc']}")
    return 0
