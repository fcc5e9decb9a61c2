"""Writing TOML values by hand (the standard library only reads TOML).

Enough for spec files: whole numbers, booleans, strings, lists and inline
tables, each written on one line.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

__all__ = ["toml_key", "toml_str", "toml_value"]


def toml_key(key: str) -> str:
    """A key, bare when it can be."""
    return key if key and re.fullmatch(r"[A-Za-z0-9_-]+", key) else toml_str(key)


def toml_str(text: str) -> str:
    """A basic string: quotes, backslashes and control characters escaped."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def toml_value(value: Any) -> str:
    """A value on one line; TypeError for what TOML cannot hold here (None, floats)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return toml_str(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{toml_key(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write a {type(value).__name__} as TOML")
