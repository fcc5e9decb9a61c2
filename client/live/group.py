"""Re-form a live job's process group and DeviceMesh in place.

The launcher's ``TCPStore`` (:mod:`ptcfs.client.live.agent`) is the
rendezvous of every generation: :func:`reform` destroys this process's
default group (a dead peer's group included) and initialises a new one over
the same store under a fresh key prefix (the generation and its phase), so
nothing of an older generation's keys is read again. The process, its
imports and its tensors stay; only the group's connections are new (a few
milliseconds on gloo for a handful of workers).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ptcfs import settings
from ptcfs.errors import LiveError

__all__ = ["connect", "reform", "mesh_of", "leave", "await_key"]

#: Between two looks at the store while waiting for a key.
_POLL_S = 0.005


def await_key(store: dist.Store, key: str, timeout: float,
              give_up: Callable[[], bool] = lambda: False) -> bool:
    """Wait until ``key`` is in ``store``: True; False when ``give_up()``
    says so first; LiveError after ``timeout`` seconds. (It looks every few
    milliseconds: a TCPStore wait that times out leaves its answer on the
    connection, which the next call would then read.)"""
    deadline = time.monotonic() + timeout
    while not store.check([key]):
        if give_up():
            return False
        if time.monotonic() > deadline:
            raise LiveError(f"{key} did not appear in the live store within {timeout:.0f} s")
        time.sleep(_POLL_S)
    return True


def connect(address: str, timeout: float | None = None) -> dist.TCPStore:
    """A client of the launcher's store at ``host:port``."""
    host, _, port = address.rpartition(":")
    try:
        return dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                             timeout=timedelta(seconds=settings.get("PTC_LIVE_TIMEOUT_S",
                                                                    timeout)))
    except (RuntimeError, ValueError) as e:
        raise LiveError(f"cannot reach the live launcher's store at {address}: "
                        f"{str(e).splitlines()[0]}") from e


def leave() -> None:
    """Destroy this process's default group, if it has one (a group whose
    peer died included)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def reform(store: dist.Store, prefix: str, me: str, members: Sequence[str],
           backend: str = "gloo", timeout: float | None = None) -> float:
    """This process's default group anew: rank ``members.index(me)`` of
    ``len(members)``, rendezvous under ``prefix`` in ``store``. Returns the
    seconds it took."""
    t0 = time.perf_counter()
    if me not in members:
        raise LiveError(f"worker {me} is not one of {list(members)}")
    leave()
    try:
        dist.init_process_group(
            backend, store=dist.PrefixStore(f"ptc-live/{prefix}/", store),
            rank=list(members).index(me), world_size=len(members),
            timeout=timedelta(seconds=settings.get("PTC_LIVE_TIMEOUT_S", timeout)))
    except RuntimeError as e:
        raise LiveError(f"worker {me}: the group {prefix} of {list(members)} did not form: "
                        f"{str(e).splitlines()[0]}") from e
    return time.perf_counter() - t0


def mesh_of(shape: tuple[int, ...], names: tuple[str, ...], device: str = "cpu") -> Any:
    """A DeviceMesh over the whole (new) default group."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device, shape, mesh_dim_names=names)
