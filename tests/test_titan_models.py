"""torchtitan models other than llama3 recognised from their names and shapes
(:mod:`ptcfs.client.formats.titan_models`), without a cluster: the state dict
of torchtitan's own tiny qwen3, qwen3 with experts and deepseek_v3
(``tests/titan_job.py``) is the checkpoint, its stacked experts one tensor
per expert as the import keeps them."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchtitan", reason="torchtitan is not installed: pip install "
                    "'ptcfs[titan]' as deploy/setup.sh does")
pytest.importorskip("transformers", reason="the spec comes from transformers' Qwen3Config")

from ptcfs.client.formats.titan_models import (  # noqa: E402
    NAMES,
    deepseek_titan,
    norm_heads,
    qwen3_hf_to_titan,
    qwen3_titan,
    qwen3_titan_to_hf,
)
from ptcfs.dcp.titan import expert_name, expert_of, is_stacked  # noqa: E402
from ptcfs.errors import CheckpointError  # noqa: E402
from tests.titan_job import (  # noqa: E402
    EXPERTS,
    HEADS,
    KV_HEADS,
    MOE_FFN,
    QWEN3_HEAD_DIM,
    _deepseek_config,
    model_config,
)

_W1 = "moe.routed_experts.inner_experts.w1_EFD"


def _shapes(model: str, config=None) -> dict[str, tuple[int, ...]]:
    """The model's tensors as a job keeps them: stacked experts one per expert."""
    with torch.device("meta"):
        m = (config or model_config(model)).build()
    out: dict[str, tuple[int, ...]] = {}
    for n, t in m.state_dict().items():
        if is_stacked(n):
            out.update({expert_name(n, j): tuple(t.shape[1:]) for j in range(t.shape[0])})
        else:
            out[n] = tuple(t.shape)
    return out


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
    assert qwen3_titan_to_hf("layers.0.moe.router.gate.weight") == "model.layers.0.mlp.gate.weight"
    assert qwen3_titan_to_hf("layers.0.attention.wkv_a.weight") is None


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


def test_torchtitan_qwen3_moe_is_transformers_qwen3_moe_under_its_names() -> None:
    shapes = _shapes("qwen3_moe")
    text, spec = qwen3_titan(shapes, "fp32")  # type: ignore[misc]
    assert text == (f"qwen3_moe:layers=2,hidden=64,heads={HEADS},kv_heads={KV_HEADS},"
                    f"head_dim={QWEN3_HEAD_DIM},vocab=256,experts={EXPERTS},moe_ffn={MOE_FFN},"
                    "names=torchtitan")
    assert {t.name: t.shape for t in spec.tensors} == shapes
    assert spec.experts == EXPERTS and dict(spec.params)["architecture"] == "Qwen3MoeForCausalLM"
    rules = {t.name: t.rule for t in spec.tensors}
    for j in range(EXPERTS):
        assert rules[f"layers.1.{_W1}.{j}"].expert == j
        assert rules[f"layers.1.{_W1}.{j}"].split_dim == 0  # transformers' plan: colwise
        assert rules[f"layers.1.moe.routed_experts.inner_experts.w2_EDF.{j}"].split_dim == 1
    assert rules["layers.1.moe.router.gate.weight"].expert is None
    bias = rules["layers.1.moe.expert_bias_E"]  # torchtitan's own: Hugging Face has none
    assert (bias.split_dim, bias.expert, bias.stage) == (None, None, 1)


@pytest.mark.parametrize("q_lora", [0, 16])
def test_torchtitan_deepseek_v3_is_transformers_deepseek_v3_under_its_names(q_lora) -> None:
    shapes = _shapes("deepseek_v3", _deepseek_config(q_lora))
    text, spec = deepseek_titan(shapes, "fp32")  # type: ignore[misc]
    assert text == (f"deepseek_v3:layers=2,hidden=64,heads={HEADS},q_lora={q_lora},kv_lora=32,"
                    "qk_nope=16,qk_rope=8,v_head=16,vocab=256,ffn=128,dense_layers=1,"
                    f"experts={EXPERTS},moe_ffn={MOE_FFN},shared_experts=1,names=torchtitan")
    assert {t.name: t.shape for t in spec.tensors} == shapes
    assert spec.experts == EXPERTS
    rules = {t.name: t.rule for t in spec.tensors}
    q = "layers.1.attention.wq_b.weight" if q_lora else "layers.1.attention.wq.weight"
    for name, dim in ((q, 0), ("layers.1.attention.wkv_b.weight", 0),
                      ("layers.1.attention.wo.weight", 1)):
        assert rules[name].split_dim == dim and [(p.units, p.unit) for p in rules[name].parts] \
            == [(HEADS, "heads")], name  # MLA split by heads (ptcfs's table)
    assert rules["layers.1.attention.wkv_a.weight"].split_dim is None
    assert [rules[f"layers.1.{_W1}.{j}"].expert for j in range(EXPERTS)] == list(range(EXPERTS))
    assert rules["layers.1.moe.shared_experts.w1.weight"].expert is None
    assert rules["layers.0.feed_forward.w1.weight"].split_dim == 0
    assert deepseek_titan(shapes, "fp32", HEADS) is not None
    with pytest.raises(CheckpointError, match=f"give {HEADS} heads"):
        deepseek_titan(shapes, "fp32", 2 * HEADS)
    assert qwen3_titan(shapes, "fp32") is None and deepseek_titan(_shapes("qwen3_moe"),
                                                                   "fp32") is None


def test_a_deepseek_v3_without_load_balancing_bias_is_recognised() -> None:
    shapes = _shapes("deepseek_v3")
    del shapes["layers.1.moe.expert_bias_E"]  # torchtitan's load_balance_coeff=None
    _, spec = deepseek_titan(shapes, "fp32")  # type: ignore[misc]
    assert {t.name: t.shape for t in spec.tensors} == shapes


def test_multi_token_prediction_layers_are_not_recognised() -> None:
    shapes = _shapes("deepseek_v3")
    shapes["mtp_layers.0.eh_proj.weight"] = (64, 128)
    assert deepseek_titan(shapes, "fp32") is None


@pytest.mark.parametrize("model", ["qwen3_moe", "deepseek_v3"])
def test_expert_names_go_both_ways(model) -> None:
    to_hf, to_titan = NAMES[model.split("_moe")[0]]
    for name in _shapes(model):
        hf = to_hf(name)
        if name.endswith("expert_bias_E") and model == "qwen3_moe":
            assert hf is None  # torchtitan's adapter names none
            continue
        assert hf is not None and to_titan(hf) == name, name
        e = expert_of(name)
        if e is not None:
            assert f".mlp.experts.{e[1]}." in hf, hf


def test_the_kept_entries_are_stored_compressed_and_read_back() -> None:
    """torchtitan's optimizer settings, a torch.save archive each, as the
    job's record keeps them (and as older records kept them)."""
    import base64
    import io
    import json
    from types import SimpleNamespace

    from ptcfs.dcp.layout import Saved, saved

    def blob(v) -> bytes:
        buf = io.BytesIO()
        torch.save(v, buf)
        return buf.getvalue()

    blobs = {f"optimizer.param_groups.layers.{i}.w.{k}": blob(v) for i in range(50)
             for k, v in (("lr", 0.01), ("betas", (0.9, 0.95)), ("eps", 1e-8))}
    kept = Saved({"a": "b"}, blobs, {"x": ("fp32", ())})
    text = kept.encode()
    assert saved(SimpleNamespace(dcp=text)) == kept
    assert len(text) * 10 < sum(map(len, blobs.values()))
    old = json.dumps({"keys": {}, "bytes": {k: base64.b64encode(v).decode()
                                            for k, v in blobs.items()}})
    assert saved(SimpleNamespace(dcp=old)) == Saved({}, blobs, {})


@pytest.mark.parametrize("model", ["qwen3_moe", "deepseek_v3"])
def test_a_job_of_hugging_face_moe_names_exports_under_torchtitans(model) -> None:
    """A job imported from Hugging Face (one tensor per expert, its names) gets
    torchtitan's names for export, each expert's as its slice of the stacked
    tensor; only qwen3's load-balancing bias, which Hugging Face lacks, is
    torchtitan's alone."""
    from types import SimpleNamespace

    from ptcfs.client.formats.hf_spec import spec_from_hf
    from ptcfs.client.formats.titan import _names, _stacked

    recognise = qwen3_titan if model == "qwen3_moe" else deepseek_titan
    _, titan = recognise(_shapes(model), "fp32")  # type: ignore[misc]
    arch = dict(titan.params)["architecture"]
    config = {"model_type": model, "architectures": [arch], "vocab_size": 256,
              "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": HEADS,
              "tie_word_embeddings": False, "num_experts_per_tok": 1,
              "moe_intermediate_size": MOE_FFN}
    if model == "qwen3_moe":
        config.update(num_key_value_heads=KV_HEADS, head_dim=QWEN3_HEAD_DIM,
                      num_experts=EXPERTS, mlp_only_layers=[])
    else:
        config.update(num_key_value_heads=HEADS, intermediate_size=128, n_routed_experts=EXPERTS,
                      n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=16,
                      kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, head_dim=8,
                      v_head_dim=16, n_group=1, topk_group=1)
    hf = spec_from_hf(config, "fp32")
    names = _names(SimpleNamespace(job="m", model_spec=lambda: hf))  # type: ignore[arg-type]
    theirs = {t.name for t in titan.tensors if not t.name.endswith("expert_bias_E")
              or model == "deepseek_v3"}
    assert sorted(names.values()) == sorted(theirs)
    assert names["model.layers.1.mlp.experts.2.down_proj.weight"] == \
        "layers.1.moe.routed_experts.inner_experts.w2_EDF.2"
    # each stacked key the export writes is its experts' Hugging Face tensors, in order
    job = SimpleNamespace(job="m", model_spec=lambda: hf)
    stacked = {c.key: c for c in _stacked(job, names, None)}  # type: ignore[arg-type]
    w2 = stacked["layers.1.moe.routed_experts.inner_experts.w2_EDF"]
    assert w2.shape == (EXPERTS, 64, MOE_FFN)
    assert [(r.name, r.index) for r in w2.runs] == [
        (f"model.layers.1.mlp.experts.{j}.down_proj.weight", j) for j in range(EXPERTS)]
