"""Choosing a mesh: every valid configuration of a job's GPUs with its
estimated memory per GPU, step time and bytes sent between hosts
(:mod:`ptcfs.suggest.search`, :mod:`ptcfs.suggest.traffic`), from
the exact layout of model state (:mod:`ptcfs.suggest.memory`) and a cost
model of one training step (:mod:`ptcfs.suggest.steptime`) on a device
(:mod:`ptcfs.suggest.device`). No torch."""

from ptcfs.suggest.device import PROFILES, Device, device_from
from ptcfs.suggest.memory import rank_state, stage_state
from ptcfs.suggest.search import (
    POLICIES,
    Estimate,
    Query,
    Suggestion,
    dominates,
    meshes,
    pareto,
    pick,
    suggest,
)

__all__ = ["PROFILES", "POLICIES", "Device", "Estimate", "Query", "Suggestion", "device_from",
           "dominates", "meshes", "pareto", "pick", "rank_state", "stage_state", "suggest"]
