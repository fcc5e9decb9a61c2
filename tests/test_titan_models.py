"""torchtitan models other than llama3 recognised from their names and shapes
(:mod:`ptcfs.client.formats.titan_models`), without a cluster: the state dict
of torchtitan's own tiny qwen3 (``tests/titan_job.py``) is the checkpoint."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchtitan", reason="torchtitan is not installed: pip install "
                    "'ptcfs[titan]' as deploy/setup.sh does")
pytest.importorskip("transformers", reason="the spec comes from transformers' Qwen3Config")

from ptcfs.client.formats.titan_models import (  # noqa: E402
    norm_heads,
    qwen3_hf_to_titan,
    qwen3_titan,
    qwen3_titan_to_hf,
)
from ptcfs.errors import CheckpointError  # noqa: E402
from tests.titan_job import HEADS, KV_HEADS, QWEN3_HEAD_DIM, model_config  # noqa: E402


def _shapes(model: str) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        m = model_config(model).build()
    return {n: tuple(t.shape) for n, t in m.state_dict().items()}


def test_torchtitan_qwen3_is_transformers_qwen3_under_its_names() -> None:
    shapes = _shapes("qwen3")
    assert "layers.0.attention.qkv_linear.wq.weight" in shapes  # the hook splits wqkv
    assert norm_heads(shapes) == HEADS
    text, spec = qwen3_titan(shapes, "fp32")  # type: ignore[misc]
    assert text.startswith(f"qwen3:layers=2,hidden=64,heads={HEADS},kv_heads={KV_HEADS},"
                           f"head_dim={QWEN3_HEAD_DIM},")
    assert {t.name: t.shape for t in spec.tensors} == shapes
    rules = {t.name: t.rule.split_dim for t in spec.tensors}
    assert rules["layers.1.attention.qkv_linear.wk.weight"] == 0
    assert rules["layers.1.attention.wo.weight"] == 1
    assert rules["layers.1.attention.q_norm.weight"] is None
    assert dict(spec.tp_divides) == {"num_attention_heads": HEADS,
                                     "num_key_value_heads": KV_HEADS}
    assert ("names", "torchtitan") in spec.params and spec.pp_only == ()
    assert qwen3_titan(shapes, "fp32", HEADS) is not None
    with pytest.raises(CheckpointError, match=f"give {HEADS} heads"):
        qwen3_titan(shapes, "fp32", 2 * HEADS)


def test_a_tied_qwen3_gets_its_output_layer_under_a_pipeline() -> None:
    shapes = _shapes("qwen3")
    del shapes["lm_head.weight"]
    _, spec = qwen3_titan(shapes, "bf16")  # type: ignore[misc]
    assert [(t.name, t.same_as) for t in spec.pp_only] == [("lm_head.weight",
                                                            "tok_embeddings.weight")]


def test_llama3_and_others_are_not_qwen3() -> None:
    assert qwen3_titan(_shapes("llama3"), "fp32") is None
    shapes = _shapes("qwen3")
    assert qwen3_titan({**shapes, "layers.0.attention.wq.bias": (128,)}, "fp32") is None
    shapes["layers.1.feed_forward.w1.weight"] = (96, 64)
    assert qwen3_titan(shapes, "fp32") is None


def test_names_go_both_ways() -> None:
    for name in _shapes("qwen3"):
        hf = qwen3_titan_to_hf(name)
        assert hf is not None and qwen3_hf_to_titan(hf) == name, name
    assert qwen3_titan_to_hf("layers.0.moe.router.gate.weight") is None


def test_a_job_of_hugging_face_qwen3_names_exports_under_torchtitans() -> None:
    from types import SimpleNamespace

    from ptcfs.client.formats.hf_spec import spec_from_hf
    from ptcfs.client.formats.titan import _names

    _, titan = qwen3_titan(_shapes("qwen3"), "fp32")  # type: ignore[misc]
    config = {"model_type": "qwen3", "vocab_size": 256, "hidden_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": HEADS,
              "num_key_value_heads": KV_HEADS, "head_dim": QWEN3_HEAD_DIM,
              "intermediate_size": 128, "tie_word_embeddings": False}
    hf = spec_from_hf(config, "fp32")
    names = _names(SimpleNamespace(job="q", model_spec=lambda: hf))  # type: ignore[arg-type]
    assert sorted(names.values()) == sorted(t.name for t in titan.tensors)
    assert _names(SimpleNamespace(job="q", model_spec=lambda: titan)) == {  # type: ignore
        t.name: t.name for t in titan.tensors}
