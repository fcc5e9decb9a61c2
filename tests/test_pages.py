"""Advice on pages (ptcfs.pages): the kernel records it where we ask, and
the tensors a load writes into carry it."""

from __future__ import annotations

import ctypes
import mmap
import re

import torch

from ptcfs.client.torch.state import new_tensor
from ptcfs.pages import HUGE_PAGE, huge_pages


def _flags(address: int) -> set[str]:
    """The VmFlags of this process's mapping that holds ``address``."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
            if m:
                inside = int(m.group(1), 16) <= address < int(m.group(2), 16)
            elif inside and line.startswith("VmFlags:"):
                return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_huge_pages_are_advised_inside_the_range_only() -> None:
    m = mmap.mmap(-1, 8 * HUGE_PAGE)
    try:
        base = ctypes.addressof(ctypes.c_char.from_buffer(m))
        start = base + 100  # not aligned: the advice begins at the next huge page
        assert huge_pages(start, 5 * HUGE_PAGE)
        first = -(-start // HUGE_PAGE) * HUGE_PAGE
        assert "hg" in _flags(first) and "hg" in _flags(first + 3 * HUGE_PAGE)
        assert "hg" not in _flags(base)  # the page before it is not advised
        # less than a whole huge page inside: nothing to advise
        assert not huge_pages(start, HUGE_PAGE)
    finally:
        m.close()


def test_a_big_tensor_to_load_into_is_advised() -> None:
    t = new_tensor((3 * HUGE_PAGE // 4,), torch.float32, torch.device("cpu"))  # 6 MiB
    assert tuple(t.shape) == (3 * HUGE_PAGE // 4,) and t.dtype == torch.float32
    assert "hg" in _flags(-(-t.data_ptr() // HUGE_PAGE) * HUGE_PAGE)
