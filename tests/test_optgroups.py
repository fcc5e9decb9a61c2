"""The optimizer's settings recorded in a job's spec and given back to each
format's groups (ptcfs.model.optgroups): pure functions of the spec."""

from __future__ import annotations

import json

from ptcfs.model.hfmodels import OPTIMIZER_GROUPS, decays, with_param
from ptcfs.model.optgroups import GROUPS, named_groups, record, recorded, settings_for
from ptcfs.model.presets import parse_model

MODEL = parse_model("llama:layers=2,hidden=64,heads=4,kv_heads=2,vocab=128,ffn=96,names=hf",
                    optimizer="adam")
PARAMS = [t.name for t in MODEL.tensors if not t.is_optim]
DECAY = [n for n in PARAMS if "norm" not in n]
REST = [n for n in PARAMS if "norm" in n]
A = {"lr": 0.01, "betas": (0.9, 0.95), "weight_decay": 0.1, "initial_lr": 0.02}
B = {"lr": 0.01, "betas": (0.9, 0.95), "weight_decay": 0.0, "initial_lr": 0.02}


def test_recorded_groups_come_back_as_they_were():
    kept, note = record(MODEL, [({**A, "params": [0, 1]}, DECAY + ["not.in.model"]), (B, REST)])
    assert note is None
    groups = recorded(kept)
    assert [g.names for g in groups] == [tuple(DECAY), tuple(REST)]  # unknown names left out
    assert [g.settings for g in groups] == [A, B]  # params dropped, betas a tuple again
    assert isinstance(groups[0].settings["betas"], tuple)
    assert recorded(MODEL) == []


def test_settings_that_are_not_json_are_not_recorded():
    kept, note = record(MODEL, [({"lr": object()}, PARAMS)])
    assert kept is MODEL and note is not None and "not plain values" in note
    kept, note = record(MODEL, [({"lr": float("nan")}, PARAMS)])
    assert kept is MODEL and note is not None


def test_a_format_with_its_own_groups_takes_the_settings_of_theirs():
    kept, _ = record(MODEL, [(A, DECAY), (B, REST)])
    # the same split: each its own; one group over all: the most tensors' settings, said
    assert settings_for(kept, [DECAY, REST]) == ([A, B], [])
    (one,), notes = settings_for(kept, [PARAMS])
    assert one == A
    assert len(notes) == 1 and "recorded groups 0, 1 whose settings differ" in notes[0]
    # groups whose settings agree are no conflict; tensors nobody recorded get None
    same, _ = record(MODEL, [(A, DECAY[:3]), (A, DECAY[3:])])
    assert settings_for(same, [DECAY, REST]) == ([A, None], [])


def test_a_format_of_named_groups_gets_them_whole_and_the_rest_apart():
    kept, _ = record(MODEL, [(A, DECAY[:4]), (B, REST)])
    assert named_groups(kept, PARAMS) == [(A, DECAY[:4]), (B, REST), (None, DECAY[4:])]
    # only the names the format has, in the recorded order; no empty group
    assert named_groups(kept, REST[:1]) == [(B, REST[:1])]
    assert named_groups(MODEL, PARAMS) == [(None, PARAMS)]


def test_a_job_recorded_by_an_earlier_ptcfs_reads_as_the_trainer_groups():
    old = with_param(MODEL, OPTIMIZER_GROUPS, json.dumps([A, B]))
    groups = recorded(old)
    params = [t for t in MODEL.tensors if not t.is_optim]
    assert [g.names for g in groups] == [tuple(t.name for t in params if decays(t)),
                                         tuple(t.name for t in params if not decays(t))]
    assert [g.settings for g in groups] == [A, B]
    # the new key wins where both are there
    both, _ = record(old, [(B, PARAMS)])
    assert GROUPS in dict(both.params)
    assert [g.settings for g in recorded(both)] == [B]
