"""A ``megatron`` dataset's views under real mounts, read by Megatron-Core's own
``IndexedDataset`` (memory-mapped and not), every sequence compared with
the source documents."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("megatron.core", reason="megatron-core is not installed "
                    "(pip install 'ptcfs[mcore]')")

from tests.datasets import make_megatron, megatron_docs, read_megatron_index  # noqa: E402
from tests.test_cluster import ptcctl  # noqa: E402
from tests.test_data_cluster import mounted, rank_dir, with_model  # noqa: E402,F401

pytestmark = [pytest.mark.multihost, pytest.mark.fuse,
              pytest.mark.filterwarnings("ignore::UserWarning")]


def test_views_are_read_by_megatron_cores_indexed_dataset(mounted, tmp_path):  # noqa: F811
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    lc = mounted
    docs = megatron_docs(40)
    make_megatron(tmp_path / "m", docs)
    with_model(lc, "mcd", dp=4)
    ptcctl(lc.cluster_file, "data", "ingest", "mcd", str(tmp_path / "m"), "--format",
           "megatron", "--global-batch", "8", "--chunk-bytes", "300")
    seen = []
    for d in range(4):
        prefix = rank_dir(lc, "mcd", d) / "data"
        _, sizes, _, doc_idx = read_megatron_index(prefix.with_suffix(".idx").read_bytes())
        for mmap in (True, False):
            ds = IndexedDataset(str(prefix), mmap=mmap)
            assert len(ds) == len(sizes) and ds.document_indices.tolist() == doc_idx.tolist()
            assert ds.sequence_lengths.tolist() == sizes.tolist()
            for k in range(len(ds)):
                seq = ds[k]
                np.testing.assert_array_equal(seq, docs[int(seq[0])], err_msg=f"{d} {k}")
                # a part of a sequence, as GPTDataset asks for it
                np.testing.assert_array_equal(ds.get(k, offset=1, length=len(seq) - 1),
                                              seq[1:])
            if mmap:
                seen += [int(ds[k][0]) for k in range(len(ds))]
    assert sorted(seen) == list(range(40))
    # GPTDataset's default index cache, <prefix>/cache/, cannot be made in the mount
    # (EACCES, as documented): Megatron-LM needs --data-cache-path elsewhere
    with pytest.raises(OSError) as e:
        os.makedirs(rank_dir(lc, "mcd", 0) / "data" / "cache" / "GPTDataset_indices")
    assert e.value.errno == errno.EACCES
