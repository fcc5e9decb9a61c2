"""What a job's committed version records about itself.

Every host stores this record as the metadata of each version it holds, so
any surviving host can tell what the job is: its model, its parallel
configuration and hosts, the training step, and how copies were placed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ptcfs.errors import InvalidRequest
from ptcfs.presets import parse_model
from ptcfs.types import Host, ModelSpec, ParallelConfig

__all__ = ["JobState"]


@dataclass(frozen=True)
class JobState:
    """One version of a job, as recorded in every host's store."""

    job: str
    version: int
    model: str  # a preset text, e.g. "gpt:layers=2,hidden=64,heads=4,vocab=1000"
    dtype: str
    optimizer: str
    config: ParallelConfig
    step: int = 0
    replicas: int = 1
    ring: tuple[str, ...] = ()  # the cluster's host order when this version was placed

    def model_spec(self) -> ModelSpec:
        return parse_model(self.model, dtype=self.dtype, optimizer=self.optimizer)

    def with_(self, **changes: Any) -> JobState:
        return replace(self, **changes)

    def to_meta(self) -> dict[str, Any]:
        c = self.config
        return {
            "job": self.job,
            "version": self.version,
            "model": self.model,
            "dtype": self.dtype,
            "optimizer": self.optimizer,
            "config": {"tp": c.tp, "pp": c.pp, "dp": c.dp,
                       "hosts": [[h.name, h.gpus] for h in c.hosts]},
            "step": self.step,
            "replicas": self.replicas,
            "ring": list(self.ring),
        }

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> JobState:
        try:
            c = meta["config"]
            cfg = ParallelConfig(int(c["tp"]), int(c["pp"]), int(c["dp"]),
                                 tuple(Host(str(n), int(g)) for n, g in c["hosts"]))
            return cls(
                job=str(meta["job"]), version=int(meta["version"]), model=str(meta["model"]),
                dtype=str(meta["dtype"]), optimizer=str(meta["optimizer"]), config=cfg,
                step=int(meta.get("step", 0)), replicas=int(meta.get("replicas", 1)),
                ring=tuple(str(h) for h in meta.get("ring", ())),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise InvalidRequest(f"job metadata is incomplete or malformed: {e!r}") from e

    def describe(self) -> str:
        c = self.config
        hosts = ",".join(f"{h.name}:{h.gpus}" for h in c.hosts)
        return f"tp={c.tp},pp={c.pp},dp={c.dp} on {hosts}"
