"""Reading a many-run view file by units equals reading it run by run."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ptcfs.data.runs import RunFile


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_copy_out_equals_the_runs_one_by_one(data):
    unit = data.draw(st.sampled_from([64, 128, 192]))
    nchunks = data.draw(st.integers(1, 3))
    rows = data.draw(st.integers(1, 12))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    chunks = [rng.integers(0, 256, rows * unit, dtype=np.uint8) for _ in range(nchunks)]
    n = data.draw(st.integers(1, 30))
    chunk = rng.integers(0, nchunks, n)
    row = rng.integers(0, rows, n)
    head = bytes(data.draw(st.integers(0, 100)))
    f = RunFile(head, "j", 1, "t", tuple(f"p{c}" for c in range(nchunks)),
                tuple(("h0",) for _ in range(nchunks)), chunk, row * unit, np.full(n, unit))
    want = head + b"".join(chunks[c][r * unit:(r + 1) * unit].tobytes()
                           for c, r in zip(chunk, row))
    assert f.size == len(want)
    offset = data.draw(st.integers(0, f.size))
    size = data.draw(st.integers(0, f.size - offset + 10))
    out = np.zeros(size, dtype=np.uint8)
    done = f.copy_out(offset, size, out, lambda c, part, hosts: chunks[c])
    got = out[:max(0, min(size, f.size - offset))].tobytes()
    assert done == (min(offset + size, f.size) > max(offset, len(head)))
    if done:
        assert got == want[offset:offset + size]
    assert not f.copy_out(offset, size, out, lambda c, part, hosts: None) or size == 0
