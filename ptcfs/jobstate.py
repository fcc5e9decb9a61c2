"""What a job's committed version records about itself.

Every host stores this record as the metadata of each version it holds, so
any surviving host can tell what the job is: its whole model spec (every
tensor and its rule, whether it came from a preset or a spec file), its
parallel configuration and hosts, the training step, and how copies were
placed.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

from ptcfs.errors import InvalidConfig, InvalidRequest, VersionImmutable
from ptcfs.model.presets import parse_model
from ptcfs.model.specfile import decode_spec, encode_spec
from ptcfs.sharding import placement
from ptcfs.types import Host, ModelSpec, ParallelConfig, Slice, TensorSpec

__all__ = ["JobState", "DEFAULT_MODE", "ACCESS_KEYS", "check_job_name", "check_mode",
           "split_foreign", "identity_of", "foreign_drops", "drop_foreign",
           "config_from_meta", "describe_config", "SAVE_MARK", "same_version"]

#: A job's mode unless it says otherwise: the owner reads and writes, its
#: group reads, others nothing.
DEFAULT_MODE = 0o640
#: The record's keys that say who may do what (``ptcctl job chown/chmod/allow``).
ACCESS_KEYS = ("owner", "mode", "writers")
#: Key in a staging version's metadata that marks a version opened for
#: saving (:mod:`ptcfs.server.ops.save`); a committed save keeps it.
SAVE_MARK = "saving"


@dataclass(frozen=True)
class JobState:
    """One version of a job, as recorded in every host's store."""

    job: str
    version: int
    model: str  # how the model was given, for display: a preset text or a spec file's name
    dtype: str
    optimizer: str
    config: ParallelConfig
    step: int = 0
    replicas: int = 1
    ring: tuple[str, ...] = ()  # the cluster's host order when this version was placed
    #: the whole model spec (:func:`ptcfs.model.specfile.encode_spec`); empty: ``model`` is a
    #: preset text that gives it
    spec: str = ""
    #: hosts a repair declared lost: they hold nothing of this version
    lost: tuple[str, ...] = ()
    #: copies a repair placed beyond the ring's: ``(tensor, slice key, hosts)``, sorted
    holders: tuple[tuple[str, str, tuple[str, ...]], ...] = ()
    #: who owns the job's files on the mount: ``(uid, gid)``; None: the mount's user
    owner: tuple[int, int] | None = None
    #: permission bits of the job's files on the mount (folders get ``x`` where ``r``)
    mode: int = DEFAULT_MODE
    #: client key names that may change the job (empty: every client key the
    #: daemons admit); daemons always may
    writers: tuple[str, ...] = ()
    #: what the last ``dcp.save`` through the mount saved besides the job's
    #: tensors (JSON: its keys and non-tensor entries, :mod:`ptcfs.dcp.layout`);
    #: carried by later versions, so a resume after a reconfiguration gets them
    dcp: str = ""
    #: drawn when the job is made and carried by every version of it: a store
    #: that holds a job of the same name under another identity (a store from
    #: another cluster, or from before the job was deleted and made again)
    #: holds none of this job's copies (:func:`split_foreign`). Empty: a job
    #: made before identities were drawn
    identity: str = field(default_factory=lambda: os.urandom(8).hex())

    def __post_init__(self) -> None:
        check_job_name(self.job)

    def model_spec(self) -> ModelSpec:
        if self.spec:
            return decode_spec(self.spec)
        return parse_model(self.model, dtype=self.dtype, optimizer=self.optimizer)

    def with_(self, **changes: Any) -> JobState:
        return replace(self, **changes)

    @cached_property
    def _extra(self) -> dict[str, dict[str, tuple[str, ...]]]:
        out: dict[str, dict[str, tuple[str, ...]]] = {}
        for tensor, part, hosts in self.holders:
            out.setdefault(tensor, {})[part] = hosts
        return out

    def extra(self, tensor: str) -> dict[str, tuple[str, ...]]:
        """The copies of ``tensor`` a repair placed: slice key → hosts."""
        return self._extra.get(tensor, {})

    def placement(self, spec: TensorSpec, model: ModelSpec | None = None,
                  lost: frozenset[str] = frozenset()) -> dict[Slice, dict[str, list[int]]]:
        """Where this version keeps the copies of ``spec``'s slices
        (:func:`ptcfs.sharding.placement` with this record's replicas, ring,
        lost hosts and repaired copies; ``lost``: more hosts to leave out)."""
        return placement(model or self.model_spec(), self.config, spec, self.replicas,
                         self.ring, frozenset(self.lost) | lost, self.extra(spec.name))

    def copy_hosts(self) -> set[str]:
        """The hosts this version's placement gives a copy of any tensor; a
        host outside them holds nothing of it but its record."""
        model = self.model_spec()
        return {h for spec in model.tensors_for(self.config.pp)
                for hosts in self.placement(spec, model).values() for h in hosts}

    def to_meta(self) -> dict[str, Any]:
        c = self.config
        return {
            "job": self.job,
            "version": self.version,
            "model": self.model,
            "dtype": self.dtype,
            "optimizer": self.optimizer,
            "config": {**c.degrees(), "hosts": [[h.name, h.gpus] for h in c.hosts]},
            "step": self.step,
            "replicas": self.replicas,
            "ring": list(self.ring),
            "spec": self.spec or encode_spec(self.model_spec()),
            **({"lost": list(self.lost)} if self.lost else {}),
            **({"holders": [[t, p, list(hs)] for t, p, hs in self.holders]}
               if self.holders else {}),
            **({"owner": list(self.owner)} if self.owner is not None else {}),
            "mode": self.mode,
            **({"writers": list(self.writers)} if self.writers else {}),
            **({"dcp": self.dcp} if self.dcp else {}),
            **({"identity": self.identity} if self.identity else {}),
        }

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> JobState:
        try:
            cfg = config_from_meta(meta["config"])
            return cls(
                job=str(meta["job"]), version=int(meta["version"]), model=str(meta["model"]),
                dtype=str(meta["dtype"]), optimizer=str(meta["optimizer"]), config=cfg,
                step=int(meta.get("step", 0)), replicas=int(meta.get("replicas", 1)),
                ring=tuple(str(h) for h in meta.get("ring", ())),
                spec=str(meta.get("spec", "")),
                lost=tuple(str(h) for h in meta.get("lost", ())),
                holders=tuple((str(t), str(p), tuple(str(h) for h in hs))
                              for t, p, hs in meta.get("holders", ())),
                owner=_owner(meta.get("owner")), mode=check_mode(meta.get("mode", DEFAULT_MODE)),
                writers=tuple(str(w) for w in meta.get("writers", ())),
                dcp=str(meta.get("dcp", "")),
                identity=str(meta.get("identity", "")),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise InvalidRequest(f"job metadata is incomplete or malformed: {e!r}") from e

    def describe(self) -> str:
        return describe_config(self.config)


#: A job's name: a folder under /ptc and part of store keys (``@`` is kept
#: for the store-jobs of datasets, ``<job>@data``).
_JOB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


def _owner(raw: Any) -> tuple[int, int] | None:
    if raw is None:
        return None
    uid, gid = raw
    return int(uid), int(gid)


def check_mode(mode: Any) -> int:
    """``mode`` if it can be a job's mode (permission bits, 0 to 0o777)."""
    if type(mode) is not int or not 0 <= mode <= 0o777:
        raise InvalidConfig(f"bad mode {mode!r}: give permission bits such as 0640 "
                            "(owner read-write, group read, others nothing)")
    return mode


def check_job_name(name: str) -> str:
    """``name`` if it can name a job, else InvalidConfig with the rule."""
    if not isinstance(name, str) or not _JOB_NAME.fullmatch(name):
        raise InvalidConfig(f"bad job name {name!r}: use letters, digits, '_', '.' and '-', "
                            "starting with a letter or digit, at most 128 characters")
    return name


def describe_config(cfg: ParallelConfig) -> str:
    """``"fsdp=2,tp=2 on h0:2,h1:2"``: the degrees as ``--config`` takes them, and the hosts."""
    hosts = ",".join(f"{h.name}:{h.gpus}" for h in cfg.hosts)
    return f"{cfg.degrees_text()} on {hosts}"


def config_from_meta(c: dict[str, Any]) -> ParallelConfig:
    """The configuration a version's metadata records (``degrees()`` and hosts)."""
    ints = {k: int(c[k]) for k in ("tp", "pp", "dp", "fsdp", "cp", "ep", "zero", "vpp",
                                              "cp_shard") if k in c}
    return ParallelConfig(
        ints.pop("tp"), ints.pop("pp"), ints.pop("dp"),
        tuple(Host(str(n), int(g)) for n, g in c["hosts"]),
        pp_layers=tuple(int(n) for n in c.get("pp_layers", ())), **ints)


def same_version(staged: dict[str, Any], committed: dict[str, Any]) -> bool:
    """Whether a host's staging version (its metadata ``staged``) is the one
    committed elsewhere under the same number (``committed``): both a save or
    both not, of one configuration. A host that was down while a
    reconfiguration took the number of a save it had open holds another."""
    return bool(staged.get(SAVE_MARK)) == bool(committed.get(SAVE_MARK)) and \
        staged.get("config") == committed.get("config")


def split_foreign(per_host: Mapping[str, list[dict[str, Any]]]
                  ) -> tuple[dict[str, list[dict[str, Any]]], dict[str, list[dict[str, Any]]]]:
    """Each host's versions of a job (``versions`` answers), split into the
    job's and those of another job of the same name (``{host: versions}``,
    hosts with none left out). The job's identity is the one most hosts'
    newest committed versions carry; where two identities are held by as
    many hosts, neither is taken for foreign (nothing tells which is the
    job). A version whose record has no identity (made before they were
    drawn, or a dataset's) is never foreign."""
    counts = Counter(i for i in map(_newest_identity, per_host.values()) if i).most_common(2)
    if len(counts) < 2 or counts[0][1] == counts[1][1]:
        return dict(per_host), {}
    own = counts[0][0]
    kept = {h: [v for v in vs if identity_of(v) in ("", own)] for h, vs in per_host.items()}
    foreign = {h: [v for v in vs if identity_of(v) not in ("", own)]
               for h, vs in per_host.items()}
    return kept, {h: vs for h, vs in foreign.items() if vs}


def identity_of(version: dict[str, Any]) -> str:
    """The job identity a ``versions`` answer's version records ("" if none)."""
    return str(version["meta"].get("identity") or "")


def _newest_identity(versions: list[dict[str, Any]]) -> str:
    committed = [v for v in versions if v["state"] == "committed"]
    return identity_of(max(committed, key=lambda v: v["version"])) if committed else ""


def foreign_drops(kept: Mapping[str, list[dict[str, Any]]],
                  foreign: Mapping[str, list[dict[str, Any]]]) -> list[tuple[str, str, int]]:
    """What removes the versions of another job of the same name from the
    hosts that hold them (:func:`split_foreign`), as ``(host, op, version)``:
    ``delete_job`` (version 0) where a host holds none of this job's
    versions, else ``delete_version`` or ``abort`` of each. They must go
    before the job puts its own there: their numbers would collide."""
    out: list[tuple[str, str, int]] = []
    for h, versions in sorted(foreign.items()):
        if not kept.get(h):
            out.append((h, "delete_job", 0))
            continue
        out += [(h, "delete_version" if v["state"] == "committed" else "abort", v["version"])
                for v in versions]
    return out


def drop_foreign(job: str, kept: Mapping[str, list[dict[str, Any]]],
                 foreign: Mapping[str, list[dict[str, Any]]],
                 call: Callable[..., Any]) -> list[tuple[str, str, int]]:
    """Run :func:`foreign_drops` with ``call(host, op, **args)``; what it ran.
    The other job's current version on a host that also holds this job's
    cannot be deleted: it stays, and is never read."""
    done = []
    for h, op, version in foreign_drops(kept, foreign):
        try:
            call(h, op, job=job, **({"version": version} if version else {}))
        except VersionImmutable:
            continue
        done.append((h, op, version))
    return done
