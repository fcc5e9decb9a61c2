"""Every causal LM of the installed transformers that has a tensor-parallel
plan, with no spec file: the spec derived from config.json through
transformers itself (ptcfs.client.formats.hf_spec) is what save_pretrained writes;
each rank's shard under tp=2 is what transformers' own sharding code gives
that rank (or, for a row of ptcfs.model.hfplan.TABLE, DTensor's Shard of each
part); and a tiny model goes save_pretrained (fp32, bf16) -> import -> tp=2
-> fsdp=2 on other hosts -> export -> from_pretrained with identical logits."""

from __future__ import annotations

import json
import re
from contextlib import contextmanager

import pytest

torch = pytest.importorskip("torch")
T = pytest.importorskip("transformers")

from safetensors import safe_open  # noqa: E402
from transformers.models.auto.configuration_auto import CONFIG_MAPPING  # noqa: E402
from transformers.models.auto.modeling_auto import (  # noqa: E402
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
)

from ptcfs.client.formats.common import read_sub  # noqa: E402
from ptcfs.client.formats.hf_spec import spec_from_hf, tp_plan  # noqa: E402
from ptcfs.client.formats.io import export_checkpoint, import_checkpoint  # noqa: E402
from ptcfs.client.torch.state import TORCH_DTYPES  # noqa: E402
from ptcfs.errors import InvalidConfig, JobNotFound  # noqa: E402
from ptcfs.model.hfplan import TABLE, generic  # noqa: E402
from ptcfs.plan.reshard import cut  # noqa: E402
from ptcfs.sharding import parse_config, parse_hosts, slice_for, validate  # noqa: E402
from tests.daemons import coordinated  # noqa: E402
from tests.test_cluster import ptcctl  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning")]

#: the sizes of every tiny model, where its config has the key
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, moe_intermediate_size=32,
            num_experts=4, num_local_experts=4, n_routed_experts=4, moe_num_experts=4,
            num_experts_per_tok=2, n_shared_experts=1, shared_expert_intermediate_size=32,
            pad_token_id=0, bos_token_id=1, eos_token_id=2, max_position_embeddings=64,
            first_k_dense_replace=1, n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=32,
            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, sliding_window=32)
#: what each needs besides (each left out says why)
EXTRA: dict[str, dict] = {"deepseek_v2": dict(head_dim=8),  # rotary over qk_rope_head_dim
                          "deepseek_v3": dict(head_dim=8),
                          "longcat_flash": dict(ffn_hidden_size=96, expert_ffn_hidden_size=32,
                                                zero_expert_num=0, num_layers=1),
                         # two layers, one of each kind, none sharing another's keys/values
                         "gemma3n_text": dict(layer_types=["sliding_attention", "full_attention"],
                                              num_kv_shared_layers=0,
                                              activation_sparsity_pattern=[0.0, 0.0],
                                              hidden_size_per_layer_input=16,
                                              laurel_rank=8, altup_num_inputs=2)}
SKIP = {"llama4": "its Llama4Config is the multimodal one; llama4_text is the causal LM",
        "phi4_multimodal": "a multimodal model (audio and vision towers)"}


def _kinds() -> list[str]:
    out = []
    for kind in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        if kind in CONFIG_MAPPING and getattr(CONFIG_MAPPING[kind], "base_model_tp_plan", None):
            out.append(kind)
    return out


KINDS = _kinds()
#: architectures whose forward pass fails in transformers itself on the tiny config this file
#: builds (before any ptcfs code runs on the logits): their round trip is checked byte for byte
NO_FORWARD = {
    "ernie4_5_moe": "selected index k out of range (top-k over the tiny config's experts)",
    "longcat_flash": "the size of tensor a (8) must match the size of tensor b (16)",
    "qwen3_next": "list index out of range (its layer types list)",
}
MUST = {"gemma", "gemma2", "gemma3_text", "phi3", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe",
        "olmo2", "mixtral", "deepseek_v3"}
INPUT = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79, 32, 38]])


def tiny(kind: str):
    """A tiny config of ``kind`` and its causal LM class name."""
    if kind in SKIP:
        pytest.skip(SKIP[kind])
    C = CONFIG_MAPPING[kind]
    base = C().to_dict()
    cfg = C(**({k: v for k, v in TINY.items() if k in base} | EXTRA.get(kind, {})))
    return cfg, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[kind]


def config_dict(cfg, arch: str) -> dict:
    d = json.loads(cfg.to_json_string())
    d["architectures"] = [arch]
    return d


def saved(kind: str, root, dtype=torch.float32):
    cfg, arch = tiny(kind)
    torch.manual_seed(0)
    m = getattr(T, arch)._from_config(cfg)
    with torch.no_grad():  # norms and biases start at constants: make every tensor count
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    m = m.to(dtype).eval()
    m.save_pretrained(root)
    return m


def files(root) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(root.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            out.update({k: st.get_tensor(k) for k in st.keys()})
    return out


@contextmanager
def fake_rank(rank: int, world: int):
    """torch.distributed's fake process group as ``rank`` of ``world`` (no
    other process: DTensor and transformers' sharding cut locally)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield DeviceMesh("cpu", list(range(world)))
    finally:
        dist.destroy_process_group()


def transformers_shard(model, name: str, full: torch.Tensor, rank: int, mesh,
                       root) -> torch.Tensor:
    """What transformers' own tensor-parallel loading gives ``rank`` of
    parameter ``name`` (shard_and_distribute_module's cut of the file's
    safetensors slice, as from_pretrained(tp_plan="auto") does)."""
    from torch.distributed.tensor import DTensor
    from transformers.integrations.tensor_parallel import (
        ALL_PARALLEL_STYLES,
        IsolatedParallel,
        _get_parameter_tp_plan,
    )

    module_name = name  # from_pretrained's key_mapping: the file's name → the module's
    for pattern, replacement in (model._checkpoint_conversion_mapping or {}).items():
        module_name, n = re.subn(pattern, replacement, module_name)
        if n:
            break
    style = _get_parameter_tp_plan(module_name, tp_plan(model))
    layer = ALL_PARALLEL_STYLES[style] if style is not None else None
    if layer is None or isinstance(layer, IsolatedParallel):  # Isolated rescales values only
        return full
    with safe_open(str(root / "model.safetensors"), "pt") as st:
        part = layer.partition_tensor(st.get_slice(name), torch.empty_like(full, device="meta"),
                                      name.rpartition(".")[2], full.dtype, True, rank, mesh)
    return part.to_local() if isinstance(part, DTensor) else part


def parts_shard(spec, full: torch.Tensor, rank: int, mesh) -> torch.Tensor:
    """DTensor's Shard of each part of a fused tensor for ``rank``, concatenated."""
    from torch.distributed.tensor import Shard, distribute_tensor

    d = spec.rule.split_dim
    pieces = torch.split(full, [p.size for p in spec.rule.parts], dim=d)
    return torch.cat([distribute_tensor(p, mesh, [Shard(d)], src_data_rank=None).to_local()
                      for p in pieces], dim=d)


@pytest.mark.parametrize("kind", KINDS)
def test_spec_is_what_save_pretrained_writes_and_shards_as_transformers(kind, tmp_path):
    m = saved(kind, tmp_path)
    cfg, arch = tiny(kind)
    model = spec_from_hf(config_dict(cfg, arch))
    on_disk = files(tmp_path)
    assert sorted((t.name, t.shape) for t in model.tensors) == \
        sorted((n, tuple(v.shape)) for n, v in on_disk.items())
    tp = parse_config("tp=2", parse_hosts("h0:2"))
    try:
        validate(model, tp)
    except InvalidConfig as e:
        pytest.skip(f"the tiny {kind} does not take tp=2: {e}")
    rows = TABLE.get(arch, {})
    for r in range(2):
        with fake_rank(r, 2) as mesh:
            for spec in model.tensors:
                full = on_disk[spec.name]
                ours = cut(spec, slice_for(spec, tp, r), full.numpy())
                want = parts_shard(spec, full, r, mesh) if generic(spec.name) in rows and \
                    spec.rule.parts else transformers_shard(m, spec.name, full, r, mesh, tmp_path)
                assert tuple(ours.shape) == tuple(want.shape), (spec.name, r)
                assert torch.equal(torch.from_numpy(ours), want.contiguous()), (spec.name, r)


def test_phi3_rank_holds_its_query_and_key_value_heads():
    """Phi-3 at tp=2: rank r's qkv_proj holds exactly its query heads and
    its key/value heads (the plan's contiguous split would not)."""
    cfg, arch = tiny("phi3")
    model = spec_from_hf(config_dict(cfg, arch))
    spec = next(t for t in model.tensors if t.name.endswith("0.self_attn.qkv_proj.weight"))
    heads, kv, hd = 4, 2, 16
    assert [(p.name, p.size, p.units) for p in spec.rule.parts] == \
        [("q", heads * hd, heads), ("k", kv * hd, kv), ("v", kv * hd, kv)]
    rows = torch.arange(spec.shape[0])[:, None].expand(spec.shape).contiguous()
    tp = parse_config("tp=2", parse_hosts("h0:2"))
    for r in range(2):
        got = torch.from_numpy(cut(spec, slice_for(spec, tp, r), rows.numpy()))[:, 0]
        q = range(r * heads // 2 * hd, (r + 1) * heads // 2 * hd)
        k = range(heads * hd + r * kv // 2 * hd, heads * hd + (r + 1) * kv // 2 * hd)
        v = [heads * hd + kv * hd + i for i in range(r * kv // 2 * hd, (r + 1) * kv // 2 * hd)]
        assert got.tolist() == [*q, *k, *v]


def test_unknown_or_planless_architectures_are_refused_in_one_line():
    with pytest.raises(InvalidConfig, match=r"GPTJForCausalLM has no tensor-parallel plan.*"
                       r"ptcctl spec --from-hf DIR.*--model-spec FILE"):
        spec_from_hf(config_dict(T.GPTJConfig(n_layer=2, n_embd=64, n_head=4, vocab_size=256),
                                 "GPTJForCausalLM"))
    with pytest.raises(InvalidConfig, match="model_type 'nope'.* is not one transformers"):
        spec_from_hf({"architectures": ["NopeForCausalLM"], "model_type": "nope"})
    with pytest.raises(InvalidConfig, match="T5ForConditionalGeneration is not a causal "
                       "language model"):
        spec_from_hf(config_dict(T.T5Config(), "T5ForConditionalGeneration"))


# --- through a cluster ------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with coordinated(tmp_path_factory.mktemp("hfspec"), 2) as cc:
        yield cc


def _logits(root, dtype):
    """from_pretrained's model of ``root`` and its logits, its tensors first
    copied out of the memory-mapped file: a matrix product's last bits
    depend on where its operands sit (the files' data start 8 bytes apart
    gives Qwen2-MoE logits 2e-7 apart from bit-identical tensors)."""
    m = T.AutoModelForCausalLM.from_pretrained(root, dtype=dtype).eval()
    with torch.no_grad():
        for t in [*m.parameters(), *m.buffers()]:
            t.data = t.data.clone()
        return m, m(INPUT).logits


def _round_trip(co, kind: str, dtype, tmp_path) -> None:
    job = f"{kind.replace('_', '-')}-{str(dtype)[6:]}"
    saved(kind, tmp_path / "in", dtype)
    r = import_checkpoint(co, job, tmp_path / "in", "hf", degrees="tp=2", hosts="h0:1,h1:1",
                          progress=False)
    model_type = json.loads((tmp_path / "in" / "config.json").read_text())["model_type"]
    assert r.state.model == f"hf:{model_type}" and r.state.config.tp == 2
    assert r.state.dtype == {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
    co.reconfigure(job, parse_config("fsdp=2", parse_hosts("h1:1,h0:1")))
    if r.state.model_spec().experts:  # experts on their own ranks too
        co.reconfigure(job, parse_config("fsdp=2,ep=2", parse_hosts("h0:1,h1:1")))
    export_checkpoint(co, job, tmp_path / "out", "hf", progress=False)
    a, b = files(tmp_path / "in"), files(tmp_path / "out")
    assert sorted(a) == sorted(b)
    for k, v in a.items():
        assert v.dtype == b[k].dtype and torch.equal(v.reshape(-1).view(torch.uint8),
                                                    b[k].reshape(-1).view(torch.uint8)), k
    if kind in NO_FORWARD:  # the bytes above are the round trip; the forward is transformers'
        return
    m1, want = _logits(tmp_path / "in", dtype)
    m2, got = _logits(tmp_path / "out", dtype)
    assert torch.equal(want, got)
    for (n, p), (_, q) in zip(m1.state_dict().items(), m2.state_dict().items()):
        assert torch.equal(p, q), n


@pytest.mark.multihost
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", sorted(MUST & set(KINDS)))
def test_round_trip_with_no_spec(cluster, tmp_path, kind, dtype):
    _round_trip(cluster[1], kind, dtype, tmp_path)


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.multihost
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", sorted(set(KINDS) - MUST))
def test_round_trip_of_every_other_architecture(cluster, tmp_path, kind, dtype):
    _round_trip(cluster[1], kind, dtype, tmp_path)


@pytest.mark.multihost
def test_phi3_job_at_tp2_stores_each_rank_its_heads(cluster, tmp_path):
    _, co = cluster
    saved("phi3", tmp_path)
    st = import_checkpoint(co, "phi3-heads", tmp_path, "hf", degrees="tp=2",
                           hosts="h0:1,h1:1", progress=False).state
    full = files(tmp_path)["model.layers.1.self_attn.qkv_proj.weight"]
    spec = next(t for t in st.model_spec().tensors if t.name ==
                "model.layers.1.self_attn.qkv_proj.weight")
    q, k, v = torch.split(full, [64, 32, 32])
    for r in range(2):
        held = torch.from_numpy(read_sub(co, st, spec, slice_for(spec, st.config, r)))
        want = torch.cat([q[r * 32:(r + 1) * 32], k[r * 16:(r + 1) * 16], v[r * 16:(r + 1) * 16]])
        assert torch.equal(held, want.view(TORCH_DTYPES["fp32"]))


@pytest.mark.multihost
def test_bad_input_is_one_line_and_creates_nothing(cluster, tmp_path):
    cf, co = cluster
    cases = []
    gptj = tmp_path / "gptj"
    torch.manual_seed(0)
    T.GPTJForCausalLM(T.GPTJConfig(n_layer=1, n_embd=64, n_head=4, vocab_size=256,
                                   n_positions=32, rotary_dim=8)).save_pretrained(gptj)
    cases.append((gptj, [], "GPTJForCausalLM has no tensor-parallel plan"))
    phi = tmp_path / "phi3"
    saved("phi3", phi)
    cases.append((phi, ["--config", "tp=4", "--hosts", "h0:2,h1:2"],
                  "tp=4 does not divide part k of model.layers.0.self_attn.qkv_proj.weight: "
                  "its 2 heads"))
    cut_short = tmp_path / "short"
    saved("qwen3", cut_short)
    f = cut_short / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    cases.append((cut_short, [], "model.safetensors"))
    for i, (path, extra, message) in enumerate(cases):
        r = ptcctl(cf, "import", f"bad{i}", str(path), "--format", "hf", *extra, check=False)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
        with pytest.raises(JobNotFound):
            co.state(f"bad{i}")


def test_spec_from_hf_command_writes_a_spec_that_loads(tmp_path):
    saved("phi3", tmp_path / "m", torch.bfloat16)
    out = tmp_path / "phi3.toml"
    ptcctl(tmp_path / "none.toml", "spec", "--from-hf", str(tmp_path / "m"), "--out", str(out))
    from ptcfs.model.specfile import load_spec_file

    model = load_spec_file(out)
    qkv = next(t for t in model.tensors if t.name.endswith("qkv_proj.weight"))
    assert qkv.dtype == "bf16" and [p.name for p in qkv.rule.parts] == ["q", "k", "v"]
    # a model without a plan: a spec to edit, every tensor replicated, on its layer's stage
    torch.manual_seed(0)
    T.GPTJForCausalLM(T.GPTJConfig(n_layer=2, n_embd=64, n_head=4, vocab_size=256,
                                   n_positions=32, rotary_dim=8)).save_pretrained(tmp_path / "j")
    ptcctl(tmp_path / "none.toml", "spec", "--from-hf", str(tmp_path / "j"), "--out", str(out))
    gptj = load_spec_file(out)
    assert gptj.layers == 2 and {t.rule.split_dim for t in gptj.tensors} == {None}
    assert {t.rule.stage for t in gptj.tensors if ".h.1." in t.name} == {1}


def test_an_unknown_layout_points_to_a_spec_file():
    """A checkpoint of names ptcfs cannot recognise (torchtitan's own, say)
    is refused with the way out: a spec file and --model-spec."""
    from ptcfs.client.formats.common import Entry, Source, infer_model
    from ptcfs.errors import CheckpointError

    src = Source({"tok_embeddings.weight": Entry((256, 64), torch.float32,
                                                 lambda: torch.zeros(256, 64), "dcp")})
    with pytest.raises(CheckpointError, match=r"tok_embeddings.weight, \.\.\.\): describe its "
                       r"model in a spec file \(`ptcctl spec --model PRESET` or `ptcctl spec "
                       r"--from-hf DIR`.*--model-spec FILE"):
        infer_model(src, 4)
