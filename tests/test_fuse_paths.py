"""The /ptc path parser and the numpy-style slice parser (pure functions)."""

from __future__ import annotations

import errno

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ptcfs.errors import InvalidRequest, JobBusy, PtcError, TensorNotFound, to_errno
from ptcfs.fuse.paths import Ref, parse_path
from ptcfs.slicing import parse_index


@pytest.mark.parametrize("path, ref", [
    ("/", Ref()),
    ("/j", Ref("j")),
    ("/j/config.json", Ref("j", area="config.json")),
    ("/j/tensors", Ref("j", area="tensors")),
    ("/j/tensors/optim/exp_avg/w.npy",
     Ref("j", area="tensors", rest=("optim", "exp_avg", "w.npy"))),
    ("/j/tensors/w.npy[0:4,:]", Ref("j", area="tensors", rest=("w.npy",), index="0:4,:")),
    ("/j/ranks/3/state.safetensors", Ref("j", area="ranks", rank=3, rest=("state.safetensors",))),
    ("/j/ranks", Ref("j", area="ranks")),
    ("/j/versions", Ref("j", area="versions")),
    ("/j/versions/7", Ref("j", 7)),
    ("/j/versions/7/ranks/0/a.b.npy[1]", Ref("j", 7, "ranks", 0, ("a.b.npy",), "1")),
    ("/j/data/ranks/0/samples.npy", Ref("j", area="data", rest=("ranks", "0", "samples.npy"))),
])
def test_paths_name_what_they_say(path, ref):
    assert parse_path(path) == ref


@pytest.mark.parametrize("path, kind", [
    ("/j/nope", TensorNotFound), ("/j/versions/x", TensorNotFound),
    ("/j/versions/01", TensorNotFound), ("/j/ranks/a", TensorNotFound),
    ("/j/config.json/x", TensorNotFound), ("/j/versions/2/versions", TensorNotFound),
    ("/j@data", TensorNotFound), ("/j/../k", TensorNotFound),
    ("/j/tensors/w.npy[0:4", InvalidRequest), ("/j/tensors/w[0]", InvalidRequest),
    ("relative", InvalidRequest),
])
def test_bad_paths_are_refused_with_the_right_errno(path, kind):
    with pytest.raises(kind):
        parse_path(path)


@given(st.text(alphabet="/abj.[]:,0123456789-@ tensorsranksversionsnpy", max_size=60))
def test_any_text_parses_or_is_refused_as_enoent_or_einval(text):
    try:
        parse_path("/" + text)
    except PtcError as e:
        assert to_errno(e) in (2, 22)


@st.composite
def sliced(draw):
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)))
    items = []
    for n in shape[: draw(st.integers(0, len(shape)))]:
        kind = draw(st.sampled_from(["index", "slice", "open", "all"]))
        if kind == "index":
            items.append(str(draw(st.integers(-n, n - 1))))
        elif kind == "slice":
            a = draw(st.integers(-n, n))
            b = draw(st.integers(-n, n))
            if (a + n if a < 0 else a) > (b + n if b < 0 else b):
                a, b = b, a
            items.append(f"{a}:{b}")
        elif kind == "open":
            items.append(f"{draw(st.integers(0, n))}:")
        else:
            items.append(":")
    return shape, ",".join(items)


@given(sliced())
def test_slices_select_what_numpy_selects(case):
    shape, text = case
    a = np.arange(int(np.prod(shape))).reshape(shape)
    box, out_shape = parse_index(text, shape)
    want = eval(f"a[{text}]", {}, {"a": a}) if text else a  # the same text, as numpy reads it
    got = a[tuple(slice(x, y) for x, y in box)].reshape(out_shape)
    assert got.shape == want.shape and (got == want).all()


@pytest.mark.parametrize("text", ["0:9", "5", "-6", "2:1", "::2", "...", "0:1,0:1,0:1", "a",
                                  "1:2:3", "[0]"])
def test_bad_slices_are_einval(text):
    with pytest.raises(InvalidRequest):
        parse_index(text, (5, 4))


def test_a_busy_job_is_eagain_at_the_mount():
    """A rank's save that a reconfiguration dropped is refused with JobBusy:
    the writer gets EAGAIN (write it again), not EIO."""
    assert to_errno(JobBusy("job 'j' version 2 is no longer open for saving")) == errno.EAGAIN
