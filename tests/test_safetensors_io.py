"""safetensors files read and written a tensor at a time, by byte ranges
(ptcfs.client.formats.safetensors_io), against the safetensors library."""

from __future__ import annotations

import json
import struct

import pytest

torch = pytest.importorskip("torch")

from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from ptcfs.client.formats.safetensors_io import read_dir, read_file, read_tensor, write_dir  # noqa: E402
from ptcfs.errors import CheckpointError  # noqa: E402


def test_safetensors_read_and_written_by_byte_ranges(tmp_path):
    want = {"a": torch.randn(4, 8).to(torch.bfloat16), "b": torch.arange(10, dtype=torch.int64),
            "c": torch.randn(300, 3, dtype=torch.float16), "d": torch.randn(2, 2)}
    save_file(want, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    found = read_dir(tmp_path)
    assert {n: (t.dtype, t.shape) for n, t in found.items()} == {
        "a": ("bf16", (4, 8)), "b": ("int64", (10,)), "c": ("fp16", (300, 3)),
        "d": ("fp32", (2, 2))}
    for n, t in found.items():
        assert read_tensor(t).tobytes() == want[n].contiguous().view(torch.uint8).numpy().tobytes()
    # written in shards of at most 1 KB (c, 1800 bytes, alone), with the index
    out = tmp_path / "out"
    items = [(n, found[n].dtype, found[n].shape) for n in sorted(found)]
    files = write_dir(out, items, lambda n: read_tensor(found[n]), max_bytes=1024)
    assert [f.name for f in files] == [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)] \
        + ["model.safetensors.index.json"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["weight_map"]["c"] == "model-00002-of-00003.safetensors"
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in found.values())
    for f in files[:-1]:
        with safe_open(str(f), "pt") as st:
            assert st.metadata() == {"format": "pt"}
            for k in st.keys():
                assert torch.equal(st.get_tensor(k), want[k]), k
    assert set(read_dir(out)) == set(want)
    # a header whose offsets run past the file is refused, naming the tensor
    raw = (tmp_path / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header["d"]["data_offsets"][1] += 4
    text = json.dumps(header).encode()
    (tmp_path / "bad.safetensors").write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])
    with pytest.raises(CheckpointError, match="tensor d: offsets"):
        read_file(tmp_path / "bad.safetensors")
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "bad.safetensors").unlink()
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match="safe_serialization=True"):
        read_dir(tmp_path)
