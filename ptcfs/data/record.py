"""The dataset record: what every host stores about a job's dataset.

It is the metadata (key ``"dataset"``) of every committed version of the
store-job ``<job>@data`` on every host, so any host can build the views
from its own store. The *base* version (the ingest) also holds the stored
bytes: chunk entries ``("chunk", "<index>")`` on their holders only, and
the per-sample index entries ``("index", <name>)`` on every host. Later
versions hold no entries; each one records a new read position.

Read position. The job consumes one global batch of ``global_batch``
samples per step from the *stream* (every epoch's order, one after the
other), so step ``s`` consumes stream samples ``[s*B, (s+1)*B)``; a batch
may straddle an epoch boundary. The committed position is a step and the
data-parallel degree the job runs with from that step on.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from ptcfs.data.formats import FORMATS
from ptcfs.data.names import BALANCES
from ptcfs.errors import BadInput, InvalidRequest
from ptcfs.jobstate import ACCESS_KEYS

__all__ = ["Chunk", "Position", "DatasetRecord", "META_KEY", "CHUNK_TENSOR", "INDEX_TENSOR",
           "chunk_part"]

#: Version metadata key of the record.
META_KEY = "dataset"
#: Stored entry names: chunks of samples, and the per-sample index.
CHUNK_TENSOR = "chunk"
INDEX_TENSOR = "index"


def chunk_part(index: int) -> str:
    """The part name of chunk ``index`` (sortable)."""
    return f"{index:08d}"


@dataclass(frozen=True)
class Chunk:
    """Samples ``[first, stop)`` in ingest order, stored whole on ``hosts``."""

    first: int
    stop: int
    hosts: tuple[str, ...]


@dataclass(frozen=True)
class Position:
    """The committed read position: the next step, and the data-parallel
    degree from that step on."""

    step: int = 0
    dp: int = 1

    def sample(self, global_batch: int) -> int:
        """The stream index of the first sample of the step."""
        return self.step * global_batch


@dataclass(frozen=True)
class DatasetRecord:
    """A job's dataset and read position (one version of ``<job>@data``).

    ``dtype`` (a numpy dtype string, ``"<u2"``) and ``sample_shape`` are the
    element type and per-sample shape of ``npy`` samples (``dtype`` is the
    token type of ``megatron``).
    ``has_tokens``: the index holds a token count per sample (``npy``,
    ``megatron``, and ``jsonl`` whose records carry a length), which the
    balanced deal needs. ``access``: for a job with no record of its own
    (a dataset ingested first), its owner, mode and writers (the keys of
    :data:`~ptcfs.jobstate.ACCESS_KEYS`, at the top of the version's
    metadata, where the mount and the daemons' authorisation read a job's).
    """

    job: str
    format: str
    count: int
    nbytes: int
    seed: int
    global_batch: int
    balance: str
    base_version: int
    chunks: tuple[Chunk, ...]
    position: Position = Position()
    version: int = 0
    dtype: str = "|u1"
    sample_shape: tuple[int, ...] = ()
    has_tokens: bool = False
    source: str = ""
    access: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_settings(self.global_batch, self.seed, self.balance, self.has_tokens, self.format)
        check_position(self.position.step, self.position.dp)

    @property
    def epoch(self) -> int:
        return self.position.sample(self.global_batch) // self.count if self.count else 0

    @property
    def offset(self) -> int:
        """The position's sample offset within its epoch."""
        return self.position.sample(self.global_batch) % self.count if self.count else 0

    def with_position(self, step: int, dp: int, version: int) -> DatasetRecord:
        return replace(self, position=Position(step, dp), version=version)

    def position_json(self) -> dict[str, Any]:
        """What ``position.json`` shows (and ``ptcctl data status``)."""
        return {"epoch": self.epoch, "step": self.position.step, "offset": self.offset,
                "sample": self.position.sample(self.global_batch),
                "global_batch": self.global_batch, "dp": self.position.dp,
                "samples_per_epoch": self.count, "balance": self.balance,
                "format": self.format, "seed": self.seed, "version": self.version}

    def to_meta(self) -> dict[str, Any]:
        return {META_KEY: {
            "job": self.job, "format": self.format, "count": self.count,
            "nbytes": self.nbytes, "seed": self.seed, "global_batch": self.global_batch,
            "balance": self.balance, "base_version": self.base_version,
            "chunks": [[c.first, c.stop, list(c.hosts)] for c in self.chunks],
            "step": self.position.step, "dp": self.position.dp, "version": self.version,
            "dtype": self.dtype, "sample_shape": list(self.sample_shape),
            "has_tokens": self.has_tokens, "source": self.source}, **self.access}

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> DatasetRecord | None:
        """The record in a version's metadata, None if it holds none."""
        d = meta.get(META_KEY)
        if d is None:
            return None
        try:
            return cls(
                job=str(d["job"]), format=str(d["format"]), count=int(d["count"]),
                nbytes=int(d["nbytes"]), seed=int(d["seed"]),
                global_batch=int(d["global_batch"]), balance=str(d["balance"]),
                base_version=int(d["base_version"]),
                chunks=tuple(Chunk(int(a), int(b), tuple(str(h) for h in hs))
                             for a, b, hs in d["chunks"]),
                position=Position(int(d["step"]), int(d["dp"])), version=int(d["version"]),
                dtype=str(d["dtype"]), sample_shape=tuple(int(n) for n in d["sample_shape"]),
                has_tokens=bool(d["has_tokens"]), source=str(d.get("source", "")),
                access={k: meta[k] for k in ACCESS_KEYS if k in meta})
        except (KeyError, TypeError, ValueError) as e:
            raise InvalidRequest(f"dataset record is incomplete or malformed: {e!r}") from e


def check_settings(global_batch: int, seed: int, balance: str, has_tokens: bool,
                   fmt: str) -> None:
    """Refuse settings that cannot work, naming the problem."""
    if fmt not in FORMATS:
        raise BadInput(f"unknown dataset format {fmt!r} (known: {', '.join(FORMATS)})")
    if global_batch < 1:
        raise BadInput(f"the global batch must be at least 1 sample, not {global_batch}")
    if not 0 <= seed < 1 << 64:
        raise BadInput(f"the seed must be a whole number in [0, 2**64), not {seed}")
    if balance not in BALANCES:
        raise BadInput(f"unknown balance {balance!r} (known: {', '.join(BALANCES)})")
    if balance == "tokens" and not has_tokens:
        raise BadInput(f"--balance tokens needs a length per sample; {fmt} samples here "
                       "have none (for jsonl, give each record a length: --length-key)")


def check_position(step: int, dp: int) -> None:
    if step < 0:
        raise BadInput(f"the step must be >= 0, not {step}")
    if dp < 1:
        raise BadInput(f"the data-parallel degree must be at least 1, not {dp}")
