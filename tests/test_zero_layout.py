"""DeepSpeed ZeRO's partition arithmetic (client/formats/zero_layout.py) as
pure functions: cutting into dp partitions and joining them gives back every
element, whatever the sizes and the degree, and the pieces a rank file names
(``param_slice_mappings``) put each parameter back together."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from ptcfs.client.formats.zero_layout import (  # noqa: E402
    fragments,
    join3,
    join_flat,
    lean,
    paddings,
    partition_size,
    split3,
    split_flat,
    sub_groups,
)

numels = st.lists(st.integers(1, 40), min_size=1, max_size=6)


@settings(max_examples=60, deadline=None)
@given(numels, st.integers(1, 5))
def test_zero12_split_then_join(sizes, dp):
    flat = torch.arange(sum(sizes), dtype=torch.float32)
    parts = split_flat(flat, dp)
    assert all(p.numel() == partition_size(flat.numel(), dp) for p in parts)
    assert (partition_size(flat.numel(), dp) * dp) % (2 * dp) == 0
    assert torch.equal(join_flat(parts, paddings(flat.numel(), dp), flat.numel(), "x"), flat)
    assert torch.equal(torch.cat(lean(parts, flat.numel())), flat)


@settings(max_examples=60, deadline=None)
@given(numels, st.integers(1, 5))
def test_zero12_fragments_put_each_parameter_back(sizes, dp):
    flat = torch.arange(sum(sizes), dtype=torch.float32)
    parts = split_flat(flat, dp)
    pieces = fragments(sizes, dp)
    offset = 0
    for i, n in enumerate(sizes):
        got = torch.cat([parts[r][start:start + k] for r in range(dp)
                         for j, start, k in pieces[r] if j == i])
        assert torch.equal(got, flat[offset:offset + n])
        offset += n
    assert all(k > 0 and start + k <= parts[r].numel()
               for r in range(dp) for _, start, k in pieces[r])


@settings(max_examples=60, deadline=None)
@given(numels, st.integers(1, 5), st.integers(1, 50))
def test_zero3_split_then_join(sizes, dp, size):
    params = [torch.arange(n, dtype=torch.float32) + 100 * i for i, n in enumerate(sizes)]
    groups = sub_groups(sizes, dp, size)
    assert [i for g in groups for i in g] == list(range(len(sizes)))
    ranks = [split3([params[i] for i in g], dp) for g in groups]
    flat = [torch.cat([r[k] for r in ranks]) for k in range(dp)]
    assert all(torch.equal(a, b) for a, b in zip(join3(flat, sizes, "x"), params, strict=True))


def test_a_short_partition_is_refused():
    from ptcfs.errors import CheckpointError

    with pytest.raises(CheckpointError, match="end before"):
        join3([torch.zeros(2), torch.zeros(2)], [9], "f.pt")
