"""Every tunable of ptcfs, in one place: name, type, default, unit, meaning.

Each is a ``PTC_*`` environment variable, read when it is used (not at
import), so a change takes effect in the next call; an explicit argument
(a command-line option, a function's keyword) wins over it. Values are
parsed one way everywhere:

- whole numbers and seconds as Python numbers (``4``, ``0.5``);
- sizes in bytes, or with a binary suffix: ``8M``, ``64MiB``, ``1G``,
  ``512k`` (K, M, G, T are powers of 1024; ``B`` and ``iB`` are optional);
- switches: ``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/``off``.

Anything else is refused with one line that names the variable
(:class:`~ptcfs.errors.InvalidConfig`). ``ptcctl config`` prints the
effective value and source of each; ``python -m ptcfs.settings`` prints
the table of ``docs/settings.md``.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ptcfs.errors import InvalidConfig

__all__ = ["Setting", "SETTINGS", "get", "source", "check_all", "parse_size", "table"]


def _memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError):
        return 8 << 30


@dataclass(frozen=True)
class Setting:
    """One tunable. ``default`` may be a function (computed when read) or
    None (unset: the code decides, as the description says)."""

    name: str
    kind: str  # "int", "float", "size", "bool", "str"
    default: Any
    unit: str
    doc: str
    minimum: float | None = None
    maximum: float | None = None

    def default_value(self) -> Any:
        return self.default() if callable(self.default) else self.default

    def default_text(self) -> str:
        if callable(self.default):
            return getattr(self.default, "__doc__", None) or "computed"
        if self.default is None:
            return "unset"
        if self.kind == "size":
            return _size_text(self.default)
        if self.kind == "bool":
            return "1" if self.default else "0"
        return str(self.default)


def _stage_keep() -> int:
    """memory/8, at most 2 GiB"""
    return min(_memory() // 8, 2 << 30)


def _warm() -> int:
    """memory/4"""
    return _memory() // 4


def _inflight() -> int:
    """memory/4, at least 4 GiB"""
    return max(_memory() // 4, 4 << 30)


_S = Setting
SETTINGS: dict[str, Setting] = {s.name: s for s in (
    _S("PTC_CLUSTER", "str", None, "path", "the cluster file, when --cluster is not given"),
    _S("PTC_HOST", "str", None, "name", "this worker's host in the cluster file (elastic "
       "training)"),
    _S("PTC_CLIENT_KEY", "str", "client", "name", "the CurveZMQ client key ptcctl and the "
       "client present: a name in the key directory's clients/, or a .key_secret file"),
    _S("PTC_LOG_LEVEL", "str", "INFO", "level", "log level of ptcd and the mount"),
    _S("PTC_PTCD", "str", None, "command", "the ptcd that local clusters start (default: the "
       "one beside this Python)"),
    _S("PTC_REGISTRY_TTL_S", "float", 3.0, "s", "lease of a host's entry in an etcd registry: "
       "a host whose daemon has not renewed it for this long is down", 2.0, 3600.0),
    _S("PTC_LOCK_TTL_S", "float", 5.0, "s", "lease of a job's lock held by a coordinator: a "
       "coordinator that dies loses it after this long", 2.0, 3600.0),
    _S("PTC_LOCK_WAIT_S", "float", 20.0, "s", "how long a coordinator waits for another's lock "
       "on the same job before it fails naming the holder", 0.0),
    _S("PTC_RECONCILE_S", "float", 1.0, "s", "how often a daemon checks the decision records of "
       "its staging versions (committing decided ones, aborting abandoned ones)", 0.05),
    _S("PTC_CATCH_UP_S", "float", 2.0, "s", "how often a daemon asks for a newer decision on "
       "each job it holds than its newest version (the registry's, or one peer's in turn), and "
       "takes the record of one made while it was down that gives it no copies; 0: never (the "
       "next command that reads the job gives it)", 0.0),
    _S("PTC_TEST_PAUSE_AT", "str", None, "point", "tests only: the coordinator of a save or a "
       "reconfiguration stops at this point (staged: before the decision is recorded; "
       "decided: after it, before any host is told; told: every host has it, none has "
       "committed; committing: the first host has committed, the others not), prints "
       "'paused at POINT' to stderr and sleeps until killed"),
    _S("PTC_KEEP_VERSIONS", "int", 2, "versions", "committed versions kept after a save or a "
       "reconfiguration, the new one included (so `dcp/` shows at most this many steps)", 1),
    _S("PTC_PLAN_SPLIT_BYTES", "size", 64 << 20, "bytes", "cross-host regions held by several "
       "hosts are cut into pieces of at most this size before balancing", 1),
    _S("PTC_SPEC_MAX_TENSORS", "int", 1 << 20, "tensors", "tensors of one model, optimizer "
       "state included: a preset or spec file with more is refused before it is built (the "
       "largest open models have a few hundred thousand)", 1),
    _S("PTC_SPEC_MAX_TENSOR_BYTES", "size", 1 << 40, "bytes", "bytes of one tensor of a model "
       "(the largest real ones: tens of GiB)", 1),
    _S("PTC_SPEC_MAX_BYTES", "size", 1 << 50, "bytes", "bytes of all of a model's tensors, "
       "optimizer state included (a trillion parameters with Adam: about 16 TiB)", 1),
    _S("PTC_STORE_MAP_SIZE", "size", 1 << 40, "bytes", "LMDB map size of a store (sparse; the "
       "most it can hold)", 1),
    _S("PTC_STORE_CHUNK_BYTES", "size", 16 << 20, "bytes", "bytes per stored chunk", 1),
    _S("PTC_STORE_WRITEMAP", "bool", None, "switch", "LMDB writemap (unset: on for stores in "
       "memory, tmpfs or ramfs, off on disk)"),
    _S("PTC_STORE_ROOM", "bool", True, "switch", "ptcd prepares store pages and staging "
       "buffers for the next version between reconfigurations"),
    _S("PTC_DAEMON_WORKERS", "int", 8, "threads", "requests ptcd serves at once", 1),
    _S("PTC_AUDIT_KEEP", "int", 1000, "entries", "changes of each job a daemon keeps for "
       "ptcctl audit (every one also goes to its log)", 1),
    _S("PTC_METRICS_PORT", "int", 0, "port", "ptcd serves Prometheus metrics on this port "
       "of its address's IP, at /metrics (0: off; ptcd --metrics-port wins)", 0, 65535),
    _S("PTC_STAGE_KEEP_BYTES", "size", _stage_keep, "bytes", "staging buffers ptcd keeps "
       "between reconfigurations (0 keeps none)", 0),
    _S("PTC_REPAIR_RATE", "size", 128 << 20, "bytes/s", "bytes per second each host fetches "
       "while repairing lost copies, so that training reads keep the rest (0: no limit)", 0),
    _S("PTC_SCRUB_RATE", "size", 32 << 20, "bytes/s", "bytes per second ptcd reads its store "
       "back in the background against the checksums written with each chunk, quarantining "
       "damaged entries (0: no background scrub; `ptcctl verify --deep` scrubs at once)", 0),
    _S("PTC_SCRUB_INTERVAL_S", "float", 3600.0, "s", "seconds from the start of one background "
       "scrub pass to the start of the next (a pass of a small store ends at once: without "
       "this, passes would follow each other and keep a core busy)", 1.0),
    _S("PTC_HEAL_AFTER_S", "float", 30.0, "s", "with an etcd registry, how long a host's lease "
       "must stay expired before the first host that is up repairs the copies it held, for "
       "every job (a host back within it costs nothing)", 0.0),
    _S("PTC_WIRE_CHUNK", "size", 8 << 20, "bytes", "payload per reply when fetching a large "
       "region", 1, 16 << 20),
    _S("PTC_BULK", "bool", True, "switch", "where the cluster has keys, reads of tensor bytes "
       "go over a second daemon socket sealed with AES-GCM (5-10x CurveZMQ's speed); 0: "
       "everything over CurveZMQ"),
    _S("PTC_BULK_PORT", "int", 0, "port", "the sealed socket's port (0: any free one; "
       "callers learn it over the CURVE socket)", 0, 65535),
    _S("PTC_WIRE_PIPELINE", "int", 4, "requests", "requests in flight per large fetch", 1),
    _S("PTC_WIRE_MAX_FRAME", "size", 1 << 30, "bytes", "largest frame a daemon accepts "
       "(clients cut puts into frames of this size)", 1, 1 << 30),
    _S("PTC_WIRE_MAX_FRAMES", "int", 64, "frames", "payload frames of one request", 1, 4096),
    _S("PTC_WIRE_MAX_REQUEST_BYTES", "size", 4 << 30, "bytes", "payload of one request (the "
       "biggest sub-tensor one put may carry)", 1),
    _S("PTC_DAEMON_PEER_INFLIGHT_BYTES", "size", 4 << 30, "bytes", "request bytes ptcd holds "
       "for one connection at once; more is refused (Overloaded)", 1),
    _S("PTC_DAEMON_INFLIGHT_BYTES", "size", _inflight, "bytes", "request bytes ptcd holds for "
       "all connections at once; more is refused (Overloaded)", 1),
    _S("PTC_CALL_TIMEOUT_S", "float", 120.0, "seconds", "the longest ptcctl or ptcd waits "
       "for a reply from a daemon that still answers liveness pings (a big read, a commit)",
       0.001),
    _S("PTC_PING_TIMEOUT_S", "float", 2.0, "seconds", "a daemon that does not answer a "
       "liveness ping within this is down", 0.001),
    _S("PTC_PEER_SILENCE_S", "float", 1.0, "seconds", "while a call waits, a daemon that has "
       "sent nothing for this long is pinged; no answer within PTC_PING_TIMEOUT_S ends the "
       "call", 0.001),
    _S("PTC_STAGE_VIEWS", "bool", True, "switch", "a stage keeps the regions a host holds "
       "already as views of the old version's entries (0: copies them, as a store without "
       "views would; for comparisons)"),
    _S("PTC_STAGE_RATE", "size", 0, "bytes/s", "for tests and demos: the most bytes per second "
       "one host's stage copies and fetches (0: no limit)", 0),
    _S("PTC_MOUNT_SPLICE", "bool", True, "switch", "the mount answers reads of local store "
       "bytes as ranges of the store file (splice)"),
    _S("PTC_MOUNT_WARM_BYTES", "size", _warm, "bytes", "bytes of each job's current version "
       "the mount reads into the page cache when it is committed (0: none)", 0),
    _S("PTC_MOUNT_WARM_MIN_BYTES", "size", 8 << 20, "bytes", "smallest tensor file the mount "
       "warms", 0),
    _S("PTC_MOUNT_PEER_TIMEOUT_S", "float", 30.0, "seconds", "how long the mount waits for a "
       "peer's answer", 0.001),
    _S("PTC_MOUNT_START_TIMEOUT_S", "float", 30.0, "seconds", "how long starting a mount waits "
       "for it to be ready", 0.001),
    _S("PTC_MOUNT_READAHEAD_KB", "int", 4096, "KiB", "kernel read-ahead of the mount", 0),
    _S("PTC_CLIENT_STAGING_BYTES", "size", 64 << 20, "bytes", "the pinned buffers a load to "
       "CUDA streams through: twice this in all, shared by its read threads", 1),
    _S("PTC_CLIENT_PROGRESS_BYTES", "size", 256 << 20, "bytes", "loads and saves of at least "
       "this size show a progress bar on a terminal", 0),
    _S("PTC_LIVE_STORE", "str", None, "host:port", "a live worker's launcher store (set by "
       "python -m ptcfs.client.live)"),
    _S("PTC_LIVE_NAME", "str", None, "name", "a live worker's name (set by the launcher)"),
    _S("PTC_LIVE_JOB", "str", None, "name", "the ptcfs job a live job's state is kept in "
       "(set by the launcher's --job; unset: the job lives in its workers' memory only)"),
    _S("PTC_LIVE_INFLIGHT_BYTES", "size", 256 << 20, "bytes", "a live change's device-to-"
       "device move keeps at most this many bytes in flight at once (all ranks together)", 1),
    _S("PTC_LIVE_TIMEOUT_S", "float", 30.0, "seconds", "a live job's collectives and "
       "rendezvous give up after this (a hung peer; a dead one is seen at once)", 0.001),
    _S("PTC_CLIENT_READ_THREADS", "int", 4, "threads", "sub-tensors (to CUDA: pieces) a "
       "load reads at once", 1),
    _S("PTC_CLIENT_LOCAL_STORE", "bool", True, "switch", "the client reads a store on its own "
       "machine directly instead of through the daemon"),
    _S("PTC_DATA_CHUNK_BYTES", "size", 16 << 20, "bytes", "a dataset is stored in chunks of "
       "whole samples of about this size", 1),
    _S("PTC_DATA_KEEP_POSITIONS", "int", 2, "positions", "committed read positions kept "
       "besides the ingested version", 1),
    _S("PTC_DATA_INGEST_INFLIGHT", "int", 4, "chunks", "chunks read and sent at once during "
       "an ingest", 1),
    _S("PTC_DATA_LOOKAHEAD_STEPS", "int", 16, "steps", "steps from the read position that "
       "data/lookahead.json gives the sample lengths of", 1),
)}

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
_SIZE = re.compile(r"(\d+)\s*([kmgt]?)(i?b)?", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``"8M"`` → 8388608; ValueError for what is not a size."""
    m = _SIZE.fullmatch(text.strip())
    if m is None:
        raise ValueError(text)
    return int(m.group(1)) << (10 * " kmgt".index(m.group(2).lower() or " "))


def _size_text(n: int) -> str:
    for shift, suffix in ((40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")):
        if n and n % (1 << shift) == 0:
            return f"{n >> shift} {suffix}"
    return f"{n} B"


_PARSERS: dict[str, Callable[[str], Any]] = {
    "int": int, "float": float, "size": parse_size, "str": str,
}
_WHAT = {"int": "a whole number", "float": "a number", "size": "a size (bytes, or 8M, 64MiB, 1G)",
         "bool": "a switch (1/0, true/false, yes/no, on/off)"}


def _parse(s: Setting, raw: str) -> Any:
    text = raw.strip()
    if s.kind == "bool":
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise InvalidConfig(f"{s.name}={raw!r} is not {_WHAT['bool']}")
    try:
        value = _PARSERS[s.kind](text)
    except ValueError:
        raise InvalidConfig(f"{s.name}={raw!r} is not {_WHAT[s.kind]}") from None
    if s.minimum is not None and value < s.minimum:
        raise InvalidConfig(f"{s.name}={raw!r} must be at least {s.minimum:g}")
    if s.maximum is not None and value > s.maximum:
        raise InvalidConfig(f"{s.name}={raw!r} must be at most {_size_text(int(s.maximum))}")
    return value


def get(name: str, explicit: Any = None) -> Any:
    """The value of setting ``name``: ``explicit`` when given, else the
    environment's (parsed now), else the default."""
    if explicit is not None:
        return explicit
    s = SETTINGS[name]
    raw = os.environ.get(name, "")
    if raw.strip():
        return _parse(s, raw)
    return s.default_value()


def source(name: str) -> str:
    """Where ``get(name)`` takes its value from: ``environment`` or ``default``."""
    return "environment" if os.environ.get(name, "").strip() else "default"


def check_all() -> None:
    """Parse every setting the environment gives (programs call it at start,
    so a bad value stops them with one line before they do anything)."""
    for name in SETTINGS:
        get(name)


def table() -> str:
    """The table of settings in ``docs/settings.md`` (Markdown)."""
    rows = ["| variable | default | unit | what it sets |", "|---|---|---|---|"]
    for s in SETTINGS.values():
        rows.append(f"| `{s.name}` | {s.default_text()} | {s.unit} | {s.doc} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    sys.stdout.write(table())
