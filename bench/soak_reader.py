"""A reader of the chaos soak (:mod:`soak`): one process that reads a job's
files through one host's mount until told to stop, and checks that each
file it read is one whole version.

What a version holds is known without asking ptcfs: step 0 is the job as
created (the driver fetched its tensors once, ``step0.npz``), and a save of
step ``s`` writes :func:`trained` for every tensor. A reader finds the
current version (the ``tensors`` link), reads its ``config.json`` (its
configuration and step) and then one of, at random:

- ``tensor``: ``versions/<v>/tensors/<name>.npy`` whole, compared with the
  step's tensor;
- ``rank``: ``versions/<v>/ranks/<r>/state.safetensors``, which must parse
  and hold exactly rank ``r``'s slices of the step's tensors;
- ``mmap``: a tensor memory-mapped (``np.load(mmap_mode="r")``) and held
  for a few seconds, across reconfigurations, then compared.

A mismatch is a *torn* read: written at once to ``torn.jsonl`` (so that a
reader killed later keeps it). Errors (a version pruned between the link
and the open is ``ENOENT``; a mount whose daemon was killed answers
``ENOTCONN``) are counted by errno name. Counts go to ``<out>.json``
every second and at exit.

``python bench/soak_reader.py MOUNT JOB DIR SEED OUT``: DIR holds
``step0.npz`` and ``stop`` (the file whose existence ends the reader).
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load as load_safetensors

from ptcfs.dtypes import numpy_dtype
from ptcfs.errors import PtcError
from ptcfs.jobstate import JobState
from ptcfs.plan.reshard import cut
from ptcfs.sharding import rank_tensors
from ptcfs.types import TensorSpec

__all__ = ["trained", "Expected", "ShortRead", "read_whole"]

#: The longest a reader holds a memory map, in seconds.
MMAP_HOLD_S = 8.0


def trained(spec: TensorSpec, step: int) -> np.ndarray:
    """What a save of ``step`` writes for ``spec`` (step > 0)."""
    n = int(np.prod(spec.shape))
    return (np.arange(n) % 89 * 0.01 + step).reshape(spec.shape).astype(
        numpy_dtype(spec.dtype))


class ShortRead(Exception):
    """A file read ended before its size (an error is an OSError instead)."""


def read_whole(path: Path) -> bytes:
    """All of a file's bytes, read as ``cat`` would; ShortRead if they end
    before the size its ``fstat`` gives."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        data = f.read()
    if len(data) != size:
        raise ShortRead(f"read {len(data)} of {size} bytes")
    return data


class Expected:
    """The logical tensors of each step (a few kept)."""

    def __init__(self, step0: Path):
        with np.load(step0) as z:
            self.step0 = {k: z[k] for k in z.files}
        self._cache: dict[tuple[int, str], np.ndarray] = {}

    def tensor(self, spec: TensorSpec, step: int) -> np.ndarray:
        if step == 0:  # a tensor that appears with pp > 1 holds its tied tensor's values
            return self.step0[spec.name if spec.name in self.step0 else str(spec.same_as)]
        key = (step, spec.name)
        if key not in self._cache:
            if len(self._cache) > 64:
                self._cache.clear()
            self._cache[key] = trained(spec, step)
        return self._cache[key]

    def sha(self, spec: TensorSpec, step: int) -> str:
        return hashlib.sha256(np.ascontiguousarray(self.tensor(spec, step)).data).hexdigest()


class Reader:
    def __init__(self, mount: Path, job: str, expect: Expected, seed: int, torn: Path):
        self.root = mount / job
        self.expect = expect
        self.rng = random.Random(seed)
        self.torn_file = torn
        self.ops: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.examples: dict[str, str] = {}  # error kind → its last message
        self.torn = 0
        self.bytes = 0

    def once(self, stop: Path) -> None:
        v = int(os.readlink(self.root / "tensors").split("/")[1])
        vdir = self.root / "versions" / str(v)
        text = (vdir / "config.json").read_text()
        try:
            state = JobState.from_meta(json.loads(text))
        except (ValueError, PtcError) as e:
            return self._torn(vdir / "config.json", v, -1, f"does not parse: {e}")
        model = state.model_spec()
        kind = self.rng.choice(("tensor", "tensor", "rank", "rank", "mmap"))
        if kind == "rank":
            r = self.rng.randrange(state.config.world)
            path = vdir / "ranks" / str(r) / "state.safetensors"
            try:
                data = read_whole(path)
            except ShortRead as e:
                return self._torn(path, v, state.step, str(e))
            try:
                got = load_safetensors(data)
            except Exception as e:  # safetensors raises its own error type on a torn file
                return self._torn(path, v, state.step, f"does not parse: {e}")
            want = {spec.name: cut(spec, sl, self.expect.tensor(spec, state.step))
                    for spec, sl in rank_tensors(model, state.config, r)}
            if set(got) != set(want):
                return self._torn(path, v, state.step, f"tensors {sorted(got)} != "
                                  f"{sorted(want)}")
            for spec, sl in rank_tensors(model, state.config, r):
                if not np.array_equal(got[spec.name], want[spec.name]):
                    return self._torn(path, v, state.step, f"{spec.name} differs: " + _diff(
                        got[spec.name], state.step,
                        lambda k, spec=spec, sl=sl: cut(spec, sl, self.expect.tensor(spec, k))))
        else:
            spec = self.rng.choice(model.tensors_for(state.config.pp))
            path = vdir / "tensors" / f"{spec.name}.npy"
            try:
                if kind == "mmap":
                    mapped = np.load(path, mmap_mode="r")
                    until = time.monotonic() + self.rng.uniform(1.0, MMAP_HOLD_S)
                    while time.monotonic() < until and not stop.exists():
                        time.sleep(0.1)
                    arr = np.array(mapped)
                    del mapped
                else:
                    arr = np.load(io.BytesIO(read_whole(path)))
            except ShortRead as e:
                return self._torn(path, v, state.step, str(e))
            except ValueError as e:  # not a whole .npy file
                return self._torn(path, v, state.step, f"does not parse: {e}")
            data = arr
            want = self.expect.tensor(spec, state.step)
            if not np.array_equal(arr, want):
                return self._torn(path, v, state.step, f"{kind} differs from the step's "
                                  "tensor: " + _diff(arr, state.step,
                                                     lambda k: self.expect.tensor(spec, k)))
        self.ops[kind] += 1
        self.bytes += memoryview(data).nbytes if isinstance(data, bytes) else data.nbytes

    def _torn(self, path: Path, v: int, step: int, why: str) -> None:
        self.torn += 1
        with open(self.torn_file, "a") as f:
            f.write(json.dumps({"path": str(path), "version": v, "step": step, "why": why,
                                "pid": os.getpid(), "at": time.time()}) + "\n")

    def summary(self) -> dict[str, Any]:
        return {"ops": dict(self.ops), "errors": dict(self.errors), "torn": self.torn,
                "bytes": self.bytes, "examples": self.examples}

    def error(self, kind: str, e: BaseException) -> None:
        self.errors[kind] += 1
        self.examples[kind] = str(e)[:300]


def _diff(got: np.ndarray, step: int, want_at: Any) -> str:
    """Where ``got`` differs from step ``step``'s values (``want_at(k)``: step
    k's), and which steps the differing values are of: a stale write shows
    an earlier step, garbage none."""
    want = want_at(step)
    if got.shape != want.shape:
        return f"shape {got.shape}, not {want.shape}"
    g, w = np.asarray(got).ravel(), np.asarray(want).ravel()
    if g.dtype != w.dtype:
        return f"dtype {g.dtype}, not {w.dtype}"
    bad = np.flatnonzero(g != w)
    of = [k for k in range(0, step + 3) if k != step and
          np.array_equal(g[bad], np.asarray(want_at(k)).ravel()[bad])]
    return (f"{bad.size} of {g.size} values differ, from index {bad[0] if bad.size else -1} "
            f"to {bad[-1] if bad.size else -1}; they are step {of or 'none'}'s "
            f"(got {g[bad[:3]].tolist()}, want {w[bad[:3]].tolist()})")


def main(argv: list[str]) -> int:
    mount, job, directory, seed, out = Path(argv[0]), argv[1], Path(argv[2]), int(argv[3]), \
        Path(argv[4])
    stop = directory / "stop"
    r = Reader(mount, job, Expected(directory / "step0.npz"), seed, directory / "torn.jsonl")
    written = 0.0
    while not stop.exists():
        try:
            r.once(stop)
        except OSError as e:
            r.error(errno.errorcode.get(e.errno or 0, type(e).__name__), e)
            time.sleep(0.05)
        except PtcError as e:
            r.error(type(e).__name__, e)
            time.sleep(0.05)
        if time.monotonic() - written > 1.0:
            _write(out, r.summary())
            written = time.monotonic()
    _write(out, r.summary())
    return 0


def _write(out: Path, doc: dict[str, Any]) -> None:
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(doc))
    tmp.replace(out)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
