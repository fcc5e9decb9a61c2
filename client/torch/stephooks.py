"""Calls a training script's optimizer makes for ptcfs once, before or
after its next step: a background save's copy off the device waited for
before the step that would change the tensors, a commit started after it.

One hook per optimizer and side runs the calls in the order they were
added: a hook that removed itself while the optimizer iterates its hooks
would break that iteration when another hook follows it (two saves before
one step, say)."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["before_step", "start_after_step", "waiting"]

Optimizer = torch.optim.Optimizer

#: the calls each optimizer makes once, before (False) or after (True) its next step
_ONCE: dict[bool, weakref.WeakKeyDictionary[Optimizer, list[Callable[[], None]]]] = {
    False: weakref.WeakKeyDictionary(), True: weakref.WeakKeyDictionary()}


def _once(optimizer: Optimizer, then: Callable[[], None], after: bool) -> None:
    """``then()`` once, before (or ``after``) ``optimizer``'s next step."""
    calls = _ONCE[after].get(optimizer)
    if calls is None:
        calls = _ONCE[after][optimizer] = []

        def run(opt: Optimizer, *_: Any) -> None:
            due = _ONCE[after].get(opt, [])
            while due:
                due.pop(0)()

        if after:
            optimizer.register_step_post_hook(run)
        else:
            optimizer.register_step_pre_hook(run)
    calls.append(then)


def before_step(optimizer: Optimizer, then: Callable[[], None]) -> None:
    """``then()`` once, before ``optimizer``'s next step."""
    _once(optimizer, then, after=False)


def start_after_step(optimizer: Optimizer, commit: Any) -> None:
    """``commit.start()`` once, after ``optimizer``'s next step."""
    _once(optimizer, commit.start, after=True)


def waiting(optimizer: Optimizer, after: bool = False) -> int:
    """How many calls wait for ``optimizer``'s next step (before it, or
    ``after``)."""
    return len(_ONCE[after].get(optimizer, ()))
