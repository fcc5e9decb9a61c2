"""Where the survivors of a failed step go on, and whose memory is the copy.

Pure: every survivor computes the same answer from the same reports (the
worker gathers them over the new group, :mod:`ptcfs.client.live.worker`).

A survivor reports its step and its *phase* in the step after it:

- ``train``: at a step boundary or in the step's forward and backward: its
  state is that of ``step``;
- ``agree``: its forward and backward of step ``step + 1`` finished (its
  gradients are complete), the agreement before the optimizer step did not
  return;
- ``optimizer``: the agreement returned, the optimizer step failed partway:
  its state is of no step;
- ``report``: the step was taken (``on_step`` ran, or failed): its state is
  that of ``step``.

The agreement is one all-reduce over every worker, so a survivor that got
past it (one step ahead of the least, or in ``optimizer``) proves that every
worker had finished step ``s + 1``'s backward, ``s`` the least step: the
``agree`` survivors hold complete gradients and take step ``s + 1``'s
optimizer step now (*roll forward*), and the job goes on at ``s + 1`` with
no step lost. The copies there are the memories of the survivors that
stepped or roll forward; one whose optimizer step failed partway holds no
copy (the plan takes its part from a replica, as a lost worker's).

:func:`settle` gives the ways to go on, best first: at ``s + 1`` as above;
then back at ``s`` from the survivors that had not stepped (when the copies
at ``s + 1`` do not cover the state, the plan says so), losing the steps the
others took. Nothing comes from a store; when no way is covered the caller
raises.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ptcfs.client.live.mover import device_plan
from ptcfs.errors import LiveError, StateLost
from ptcfs.types import Generation, ModelSpec, ParallelConfig, Plan

__all__ = ["AGREE", "OPTIMIZER", "REPORT", "TRAIN", "Report", "Said", "Settle", "go_on", "settle"]

TRAIN, AGREE, OPTIMIZER, REPORT = "train", "agree", "optimizer", "report"


@dataclass(frozen=True)
class Report:
    """One survivor's word at a change."""

    name: str
    step: int
    phase: str = TRAIN


@dataclass(frozen=True)
class Settle:
    """A way to go on: the step, who takes that step's optimizer step first,
    whose memory holds no copy of it, and the steps lost (taken by a
    survivor, to be trained again)."""

    step: int
    roll_forward: frozenset[str] = frozenset()
    no_copy: frozenset[str] = frozenset()
    steps_lost: int = 0


def settle(reports: Sequence[Report]) -> list[Settle]:
    """The ways to go on, best first (see the module docstring)."""
    if not reports:
        raise LiveError("no worker survived to report its step")
    low = min(r.step for r in reports)
    high = max(r.step for r in reports)
    if high - low > 1:
        raise LiveError(f"the surviving workers are at steps {low} and {high}, more than one "
                        "step apart; restart the job from its last commit")
    if high == low and all(r.phase != OPTIMIZER for r in reports):
        return [Settle(low)]  # nobody got past the agreement: every state is at `low`
    behind = [r for r in reports if r.step == low]
    forward = Settle(low + 1,
                     frozenset(r.name for r in behind if r.phase == AGREE),
                     frozenset(r.name for r in behind if r.phase != AGREE))
    back = Settle(low, no_copy=frozenset(r.name for r in reports
                                         if r.step == high and high > low
                                         or r.phase == OPTIMIZER),
                  steps_lost=high - low)
    if len(back.no_copy) == len(reports):
        return [forward]
    return [forward, back]


#: A survivor's word as the worker gathers it: its report, the model spec,
#: the last step agreed with its mean loss, and the last step it reported.
Said = tuple[Report, ModelSpec, tuple[int, float], int]


def go_on(said: Sequence[Said], gen: Generation, old: ParallelConfig,
          new: ParallelConfig) -> tuple[Plan, Settle, tuple[int, float] | None]:
    """The first way of :func:`settle` whose copies cover the state, its
    device plan, and the step to report again with its loss (None: none):
    when the previous generation's first worker survived without having
    reported the step the job goes on at. LiveError when no way is covered."""
    reports = [r for r, *_ in said]
    model = said[0][1]
    for way in settle(reports):  # raises when no worker survived
        try:
            p = device_plan(model, old, new, frozenset(gen.lost) | way.no_copy)
        except StateLost:
            continue
        losses = dict(a for _, _, a, _ in said)
        first = next((x for x in said if x[0].name == gen.previous[0]), None)
        replay = None
        if way.step in losses and first is not None and first[3] < way.step:
            replay = (way.step, losses[way.step])
        return p, way, replay
    steps = sorted({r.step for r in reports})
    raise LiveError(f"generation {gen.number}: no survivor's memory holds the whole state "
                    f"at step {' or '.join(map(str, steps))} (lost: "
                    f"{', '.join(gen.lost) or 'none'}); restart the job from its last commit")
