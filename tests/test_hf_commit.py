"""What a ``save_pretrained`` into ``hf-save/`` puts, as pure functions: a
tensor saved in a narrower dtype than the job holds (transformers keeps
Apertus's xIELU ``alpha_p`` in bf16 whatever ``from_pretrained`` was asked
for) is taken, widened exactly, only where the job's values fit that dtype,
and one in a wider dtype (ERNIE-4.5-MoE's router, kept in fp32) only where
its own values do;
a 0-d tensor (xIELU's ``beta`` buffer) is put as 0-d; a config.json of another
model_type than the job's is refused."""

from __future__ import annotations

import numpy as np
import pytest

from ptcfs.errors import InvalidRequest
from ptcfs.fuse.formats import Declared
from ptcfs.fuse.hfcommit import as_job_holds, check, describes
from ptcfs.fuse.spool import put_array
from ptcfs.sharding import layout_of, parse_config, parse_hosts
from ptcfs.types import ShardRule, TensorSpec

SPEC = TensorSpec("model.layers.0.mlp.act_fn.alpha_p", (2,), "fp32", ShardRule(stage=0))


def _bf16(values: list[float]) -> np.ndarray:
    return (np.array(values, np.float32).view(np.uint32) >> 16).astype(np.uint16)


def test_a_narrower_dtype_is_taken_where_the_job_holds_its_values():
    d = Declared(SPEC.name, "bf16", (2,), 0, 4)
    check("f", d, {SPEC.name: SPEC})
    now = np.array([0.5, -1.25], np.float32)  # both bf16 values
    got = as_job_holds("f", d, _bf16([0.75, 2.0]), SPEC, lambda: now)
    assert got.dtype == np.float32 and got.tolist() == [0.75, 2.0]
    same = Declared(SPEC.name, "fp32", (2,), 0, 8)
    assert as_job_holds("f", same, now, SPEC, lambda: pytest.fail("not read")) is now


def test_a_model_loaded_narrower_than_the_job_is_refused():
    d = Declared(SPEC.name, "bf16", (2,), 0, 4)
    now = np.array([0.5, 1.0 + 2.0 ** -20], np.float32)  # low bits bf16 drops
    with pytest.raises(InvalidRequest, match=r"f: model.layers.0.mlp.act_fn.alpha_p is bf16; "
                       r"the job holds it as fp32 with values bf16 cannot hold \(load the model "
                       r"with the job's dtype, fp32"):
        as_job_holds("f", d, _bf16([0.5, 1.0]), SPEC, lambda: now)
    for dtype, shape in (("fp32", (3,)), ("fp16", (2, 1))):  # wider, or another shape
        with pytest.raises(InvalidRequest, match="the job holds it as fp32 \\[2\\]"):
            check("f", Declared(SPEC.name, dtype, shape, 0, 12), {SPEC.name: SPEC})
    half = TensorSpec("h", (2,), "bf16", ShardRule(stage=0))
    with pytest.raises(InvalidRequest, match="h is fp16 \\[2\\]; the job holds it as bf16"):
        check("f", Declared("h", "fp16", (2,), 0, 4), {"h": half})


def test_a_wider_dtype_is_taken_where_its_values_fit_the_jobs():
    half = TensorSpec("model.layers.1.mlp.gate.weight", (2,), "bf16", ShardRule(stage=1))
    d = Declared(half.name, "fp32", (2,), 0, 8)
    check("f", d, {half.name: half})
    saved = np.array([0.5, -1.25], np.float32)
    got = as_job_holds("f", d, saved, half, lambda: pytest.fail("not read"))
    assert got.dtype == np.uint16 and got.tolist() == _bf16([0.5, -1.25]).tolist()
    with pytest.raises(InvalidRequest, match=r"^f: model.layers.1.mlp.gate.weight is fp32 with "
                       r"values bf16, the dtype the job holds it in, cannot hold \(cast it to "
                       r"bf16 before saving\)$"):
        as_job_holds("f", d, np.array([0.5, 1.0 + 2.0 ** -20], np.float32), half, lambda: None)


def test_a_scalar_is_put_as_a_scalar():
    spec = TensorSpec("model.layers.0.mlp.act_fn.beta", (), "fp32", ShardRule(stage=0))
    puts = []
    config = parse_config("tp=2", parse_hosts("h0:1,h1:1"))
    for sl in layout_of(spec, config).slices():
        put_array(lambda *a, **kw: puts.append(a), "j", spec, sl, np.array(0.5, np.float32), 0)
    assert [(p[2], tuple(p[4]), bytes(p[3])) for p in puts] == \
        [("full", (), np.float32(0.5).tobytes())]


def test_a_config_of_another_model_type_is_refused():
    """An architecture ptcfs derives through transformers at import (the
    mount does not load it): the saved config.json must name the job's
    model_type and architectures; other keys may change."""
    import json

    params = {SPEC.name: SPEC}
    job = {"model_type": "apertus", "architectures": ["ApertusForCausalLM"], "rope_theta": 1.0}
    mine = json.dumps(job)
    describes("c", json.dumps({**job, "rope_theta": 2.0}), params, mine)
    describes("c", json.dumps({"model_type": "other"}), params, None)  # nothing recorded
    describes("c", json.dumps(job), params, json.dumps({"model_type": "apertus"}))
    with pytest.raises(InvalidRequest, match=r"^c: describes another model than the job's "
                       r"\(model_type 'qwen3'; the job's is 'apertus'\)$"):
        describes("c", json.dumps({**job, "model_type": "qwen3"}), params, mine)
    with pytest.raises(InvalidRequest, match=r"architectures \['X'\]; the job's is"):
        describes("c", json.dumps({**job, "architectures": ["X"]}), params, mine)
    with pytest.raises(InvalidRequest, match="^c: not a JSON object$"):
        describes("c", "[1]", params, mine)
