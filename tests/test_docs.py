"""The README is a guide and ``docs/`` the reference: the guide's table of
``ptcctl`` commands is the parser's, and every link between the pages lands
on a file and a heading that exist. (Their examples run in
``tests/test_readme_examples.py``.)"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from ptcfs.client.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")),
         "bench/README.md"]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _commands(parser: argparse.ArgumentParser, prefix: str = "ptcctl") -> list[tuple[str, str]]:
    """(``ptcctl job create``, its help) for every command that runs, in the help's order."""
    out: list[tuple[str, str]] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for name, sub in action.choices.items():
                nested = _commands(sub, f"{prefix} {name}")
                out += nested or [(f"{prefix} {name}", helps[name])]
    return out


def test_the_guide_lists_every_ptcctl_command_with_its_help():
    text = (ROOT / "README.md").read_text()
    rows = re.findall(r"^\| `(ptcctl [a-z -]+)` \| (.+?) \| .+ \|$", text, re.M)
    assert [(c, h.replace("`", "")) for c, h in rows] == _commands(build_parser())


def test_the_guide_stays_a_guide():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 350


def _slugs(path: Path) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown file."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    fenced = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        m = None if fenced else re.match(r"^#{1,6} (.+)$", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


@pytest.mark.parametrize("page", PAGES)
def test_links_land_on_a_file_and_a_heading(page: str):
    src = ROOT / page
    for target in LINK.findall(src.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        file, _, anchor = target.partition("#")
        dest = (src.parent / file).resolve() if file else src
        assert dest.exists(), f"{page}: {target}: no such file"
        if anchor:
            assert anchor in _slugs(dest), f"{page}: {target}: no such heading"
