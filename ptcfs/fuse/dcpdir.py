"""``/ptc/<job>/dcp/``: each kept step of a job as a DCP checkpoint folder.

``step-<N>/`` for every step of a committed version, the newest version
of that step (a reconfiguration keeps the step, so the folder shows the
newest layout); its files are :func:`ptcfs.dcp.view.view_files` of that
version. Which versions are committed is the job's retention
(``PTC_KEEP_VERSIONS`` newest, pruned after every save and
reconfiguration), not the trainer's: a reconfiguration's version and the
one it came from share a step, so the folder then shows one step fewer
than the versions kept. Folders of saves being written through the mount
(:mod:`ptcfs.fuse.dcpwrite`) are listed too, with what has been written.
"""

from __future__ import annotations

import re
from typing import Any

from ptcfs.errors import TensorNotFound

__all__ = ["STEP", "step_name", "parse_step", "steps", "check_rest"]

STEP = re.compile(r"step-(0|[1-9]\d*)")


def step_name(step: int) -> str:
    return f"step-{step}"


def parse_step(name: str) -> int | None:
    m = STEP.fullmatch(name)
    return int(m.group(1)) if m else None


def steps(committed: dict[int, dict[str, Any]]) -> dict[int, int]:
    """step → the newest committed version of that step."""
    out: dict[int, int] = {}
    for v, meta in committed.items():
        s = int(meta.get("step", 0))
        out[s] = max(out.get(s, -1), v)
    return out


def check_rest(job: str, rest: tuple[str, ...]) -> int:
    """The step a path below ``/<job>/dcp/`` names (its first component)."""
    step = parse_step(rest[0])
    if len(rest) > 2 or step is None:
        raise TensorNotFound(f"/{job}/dcp/{'/'.join(rest)}: the dcp folder holds "
                             "step-<N>/ folders of checkpoint files")
    return step
