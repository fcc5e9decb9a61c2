"""ptcctl import/export --format hf: tiny models built and saved by transformers
itself go into a job, through other meshes, and back out to from_pretrained
bit for bit."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors import safe_open  # noqa: E402

from ptcfs.client.formats.hf import TRAINER_NOTE, write_hf  # noqa: E402
from ptcfs.client.formats.io import export_checkpoint, import_checkpoint  # noqa: E402
from ptcfs.errors import CheckpointError  # noqa: E402
from ptcfs.sharding import parse_config, parse_hosts  # noqa: E402
from tests.daemons import coordinated  # noqa: E402
from tests.test_cluster import ptcctl  # noqa: E402

pytestmark = [pytest.mark.multihost,
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

T = transformers
SIZES = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)
#: name → (config, dtype, save_pretrained's max_shard_size, the meshes after import)
ARCHS = {
    "llama": (lambda: T.LlamaConfig(**SIZES), torch.float32, "40KB",
              ["tp=2,fsdp=2", "pp=2,dp=2"]),
    "mistral": (lambda: T.MistralConfig(**SIZES), torch.float16, None,
                ["tp=2,fsdp=2", "pp=2,dp=2"]),
    "qwen2": (lambda: T.Qwen2Config(**SIZES, tie_word_embeddings=True), torch.bfloat16, None,
              ["tp=2,fsdp=2", "pp=2,dp=2"]),
    "mixtral": (lambda: T.MixtralConfig(**SIZES, num_local_experts=4), torch.float32, None,
                ["fsdp=2,tp=2,ep=2", "pp=2,dp=2"]),
    "gpt2": (lambda: T.GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4,
                                  n_positions=32), torch.float32, None,
             ["tp=2,fsdp=2", "pp=2,dp=2"]),
}
INPUT = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79, 32, 38]])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with coordinated(tmp_path_factory.mktemp("hf"), 2) as cc:
        yield cc


def saved(arch: str, root):
    """A random model of ``arch`` (seed 0) saved with save_pretrained to ``root``."""
    make, dtype, shard, _ = ARCHS[arch]
    torch.manual_seed(0)
    m = T.AutoModelForCausalLM.from_config(make()).to(dtype).eval()
    m.save_pretrained(root, **({"max_shard_size": shard} if shard else {}))
    return m


def tensors(root) -> dict[str, torch.Tensor]:
    """Every tensor of a model directory's safetensors files."""
    out = {}
    for f in sorted(root.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            out.update({k: st.get_tensor(k) for k in st.keys()})
    return out


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k, v in a.items():
        assert v.dtype == b[k].dtype and v.shape == b[k].shape, k
        assert torch.equal(v.view(torch.uint8), b[k].view(torch.uint8)), k


#: from_pretrained's dtype argument (torch_dtype before 4.56)
DTYPE_ARG = "dtype" if tuple(int(x) for x in T.__version__.split(".")[:2]) >= (4, 56) \
    else "torch_dtype"


def load(root, dtype):
    return T.AutoModelForCausalLM.from_pretrained(root, **{DTYPE_ARG: dtype}).eval()


def check_export(m, src, out, dtype) -> None:
    """``out`` loads with from_pretrained to ``m``'s every tensor, and to the
    logits of ``src`` loaded the same way (``m.to(dtype)`` also casts the
    rotary buffers, from_pretrained does not)."""
    m2 = load(out, dtype)
    same(m.state_dict(), m2.state_dict())
    with torch.no_grad():
        assert torch.equal(load(src, dtype)(INPUT).logits, m2(INPUT).logits)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "mixtral"])
def test_round_trip(cluster, tmp_path, arch):
    _, co = cluster
    m = saved(arch, tmp_path / "in")
    if ARCHS[arch][2]:
        assert (tmp_path / "in" / "model.safetensors.index.json").is_file()
    r = import_checkpoint(co, arch, tmp_path / "in", "hf", progress=False)
    assert (r.state.model, r.state.optimizer, r.state.config.world) == (f"hf:{arch}", "none", 1)
    for mesh in ARCHS[arch][3]:
        co.reconfigure(arch, parse_config(mesh, parse_hosts("h0:2,h1:2")))
    st = export_checkpoint(co, arch, tmp_path / "out", "hf", progress=False)
    assert st.version == 3 and st.config.pp == 2
    same(tensors(tmp_path / "in"), tensors(tmp_path / "out"))
    assert (tmp_path / "out" / "config.json").read_text() == \
        (tmp_path / "in" / "config.json").read_text()
    check_export(m, tmp_path / "in", tmp_path / "out", ARCHS[arch][1])


@pytest.mark.slow
def test_gpt2_round_trip_by_command(cluster, tmp_path):
    cf, co = cluster
    m = saved("gpt2", tmp_path / "in")
    out = json.loads(ptcctl(cf, "import", "gpt2", str(tmp_path / "in"), "--format", "hf",
                            "--config", "tp=2,fsdp=2", "--hosts", "h0:2,h1:2", "--json").stdout)
    assert (out["model"], out["dtype"], out["config"]) == ("hf:gpt2", "fp32",
                                                           "tp=2,pp=1,dp=1,fsdp=2 on h0:2,h1:2")
    ptcctl(cf, "reconfigure", "gpt2", "--to", "pp=2,dp=2", "--hosts", "h0:2,h1:2")
    ptcctl(cf, "export", "gpt2", str(tmp_path / "out"), "--format", "hf")
    assert "lm_head.weight" not in tensors(tmp_path / "out")  # tied, as save_pretrained writes
    same(tensors(tmp_path / "in"), tensors(tmp_path / "out"))
    check_export(m, tmp_path / "in", tmp_path / "out", torch.float32)
    assert co.state("gpt2").model_spec().name == "gpt2"


def test_adam_bf16_export_keeps_fp32_state(cluster, tmp_path):
    """A bf16 LLaMA job with Adam: optimizer.pt has fp32 moments in the Trainer's
    groups, master/ the fp32 masters, bit for bit; the directory imports back."""
    cf, co = cluster
    model = "llama:layers=2,hidden=64,heads=4,kv_heads=2,vocab=256,ffn=96,names=hf"
    ptcctl(cf, "job", "create", "adam", "--model", model, "--dtype", "bf16", "--optimizer",
           "adam", "--config", "tp=2", "--hosts", "h0:1,h1:1")
    st = co.state("adam")
    out = tmp_path / "out"
    files = write_hf(co, st, out, progress=False, max_shard_bytes=60_000)
    assert len(files) > 2 and files[-1].name == "model.safetensors.index.json"

    def job(name: str, dtype=torch.float32) -> torch.Tensor:
        a = co.fetch_tensor(st, name)
        return torch.from_numpy(a).view(torch.bfloat16) if dtype == torch.bfloat16 else \
            torch.from_numpy(a)

    m = load(out, torch.bfloat16)
    names = [n for n, _ in m.named_parameters()]
    for n, p in m.named_parameters():
        assert p.dtype == torch.bfloat16 and torch.equal(p.detach(), job(n, torch.bfloat16)), n
    masters = load(out / "master", torch.float32)
    for n, p in masters.named_parameters():
        assert p.dtype == torch.float32
        assert torch.equal(p.detach().view(torch.int32), job(f"optim/master/{n}").view(
            torch.int32)), n
    # optimizer.pt loads into AdamW over the Trainer's two groups of the master model
    decay = set(T.Trainer.get_decay_parameter_names(None, masters))
    params = dict(masters.named_parameters())
    groups = [[params[n] for n in names if n in decay], [params[n] for n in names
                                                         if n not in decay]]
    opt = torch.optim.AdamW([{"params": g} for g in groups])
    opt.load_state_dict(torch.load(out / "optimizer.pt", weights_only=True))
    for n, p in params.items():
        s = opt.state[p]
        assert float(s["step"]) == st.step
        for kind in ("exp_avg", "exp_avg_sq"):
            assert s[kind].dtype == torch.float32
            assert torch.equal(s[kind].view(torch.int32),
                               job(f"optim/{kind}/{n}").view(torch.int32)), (kind, n)
    # and the directory comes back in as the same job
    ptcctl(cf, "import", "adam2", str(out), "--format", "hf")
    st2 = co.state("adam2")
    assert (st2.optimizer, st2.dtype, st2.step) == ("adam", "bf16", st.step)
    for t in st.model_spec().tensors:
        np.testing.assert_array_equal(co.fetch_tensor(st2, t.name), co.fetch_tensor(st, t.name),
                                      err_msg=t.name)


def test_trainer_checkpoint_imports_with_its_adam_state(cluster, tmp_path):
    """optimizer.pt of AdamW over the Trainer's two groups after a step, and
    trainer_state.json, as the Trainer leaves them in checkpoint-N/."""
    _, co = cluster
    m = saved("qwen2", tmp_path).float()
    decay = set(T.Trainer.get_decay_parameter_names(None, m))
    named = list(m.named_parameters())
    opt = torch.optim.AdamW([{"params": [p for n, p in named if n in decay],
                              "weight_decay": 0.1},
                             {"params": [p for n, p in named if n not in decay],
                              "weight_decay": 0.0}])
    m(INPUT, labels=INPUT).loss.backward()
    opt.step()
    m.save_pretrained(tmp_path)
    torch.save(opt.state_dict(), tmp_path / "optimizer.pt")
    (tmp_path / "trainer_state.json").write_text(json.dumps({"global_step": 7}))
    r = import_checkpoint(co, "trainer", tmp_path, "hf", degrees="tp=2", hosts="h0:1,h1:1",
                          progress=False)
    st = r.state
    assert (st.optimizer, st.dtype, st.step) == ("adam", "fp32", 7)
    for n, p in named:
        np.testing.assert_array_equal(co.fetch_tensor(st, n), p.detach().numpy(), err_msg=n)
        for kind in ("exp_avg", "exp_avg_sq"):
            np.testing.assert_array_equal(co.fetch_tensor(st, f"optim/{kind}/{n}"),
                                          opt.state[p][kind].numpy(), err_msg=f"{kind} {n}")


@pytest.mark.slow
def test_a_trainer_checkpoint_resumes_in_the_trainer_after_two_meshes(cluster, tmp_path):
    """The HF Trainer trains a tiny LLaMA 4 steps (AdamW, weight decay, a
    linear schedule with warm-up), saving checkpoint-2. That checkpoint goes
    into ptcfs, through two meshes, and back out; a second Trainer resumes
    from the export and ends with the first one's weights bit for bit: the
    moments, the learning rate and the schedule all came back (the Trainer
    loads optimizer.pt only next to a scheduler.pt)."""
    pytest.importorskip("accelerate")
    _, co = cluster
    first = _trainer(tmp_path / "a")
    first.train()
    r = import_checkpoint(co, "resume", tmp_path / "a" / "checkpoint-2", "hf", degrees="tp=2",
                          hosts="h0:1,h1:1", progress=False)
    assert (r.state.optimizer, r.state.step) == ("adam", 2)
    for mesh in ("fsdp=2,tp=2", "pp=2,dp=2"):
        co.reconfigure("resume", parse_config(mesh, parse_hosts("h0:2,h1:2")))
    export_checkpoint(co, "resume", tmp_path / "export", "hf", progress=False)
    for f in ("optimizer.pt", "scheduler.pt", "trainer_state.json"):
        assert (tmp_path / "export" / f).is_file(), f
    _resumed_ends_where(first, tmp_path / "export", tmp_path / "b")


class _Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = (torch.arange(12) * (i + 3)) % 256
        return {"input_ids": ids, "labels": ids}


class _InOrder(T.Trainer):  # the same batches whatever the RNG (ptcfs keeps none)
    def _get_train_sampler(self, *args, **kw):
        return torch.utils.data.SequentialSampler(self.train_dataset)


def _trainer(out) -> T.Trainer:
    """A Trainer of a tiny LLaMA: 4 steps of AdamW with weight decay and a
    linear schedule with warm-up, saving checkpoint-2 and checkpoint-4."""
    args = T.TrainingArguments(
        output_dir=str(out), max_steps=4, save_steps=2, per_device_train_batch_size=2,
        learning_rate=5e-3, weight_decay=0.1, lr_scheduler_type="linear", warmup_steps=1,
        report_to=[], use_cpu=True, seed=0, disable_tqdm=True, dataloader_num_workers=0)
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(T.LlamaConfig(**SIZES))
    return _InOrder(model=model, args=args, train_dataset=_Tokens())


def _resumed_ends_where(first: T.Trainer, export, out) -> None:
    """A second Trainer resumed from ``export`` ends with ``first``'s weights,
    bit for bit."""
    second = _trainer(out)
    second.train(resume_from_checkpoint=str(export))
    assert second.state.global_step == 4
    want = dict(first.model.named_parameters())
    for n, p in second.model.named_parameters():
        assert torch.equal(p.detach().view(torch.int32), want[n].detach().view(torch.int32)), n


@pytest.mark.slow
def test_a_job_from_a_dcp_checkpoint_resumes_in_the_trainer(cluster, tmp_path):
    """A job that never was a Trainer checkpoint: the first Trainer's state at
    step 2 saved with dcp.save as a plain training loop saves it (the model,
    and AdamW's state dict over the same two groups). Imported, reconfigured
    and exported as hf, it gets a scheduler.pt at its step and rates, so a
    Trainer resumes from it with its moments, rates and weight decay and ends
    where the first run did, bit for bit."""
    pytest.importorskip("accelerate")
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    cf, co = cluster
    first = _trainer(tmp_path / "a")
    first.train()
    ck = tmp_path / "a" / "checkpoint-2"
    model = T.AutoModelForCausalLM.from_pretrained(ck)
    decay = set(T.Trainer.get_decay_parameter_names(None, model))
    named = list(model.named_parameters())
    opt = torch.optim.AdamW([{"params": [p for n, p in named if n in decay]},
                             {"params": [p for n, p in named if n not in decay]}])
    opt.load_state_dict(torch.load(ck / "optimizer.pt", weights_only=True))
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "dcp"))
    ptcctl(cf, "import", "fromdcp", str(tmp_path / "dcp"), "--format", "torch-dcp", "--heads",
           str(SIZES["num_attention_heads"]), "--config", "tp=2", "--hosts", "h0:1,h1:1")
    co.reconfigure("fromdcp", parse_config("fsdp=2,tp=2", parse_hosts("h0:2,h1:2")))
    notes: list[str] = []
    export_checkpoint(co, "fromdcp", tmp_path / "export", "hf", progress=False, notes=notes)
    sched = torch.load(tmp_path / "export" / "scheduler.pt", weights_only=True)
    real = torch.load(ck / "scheduler.pt", weights_only=True)
    assert sched == real  # the Trainer's own schedule state at step 2
    # what the job cannot know (the Trainer's arguments), done as the export's note says
    assert notes == [TRAINER_NOTE]
    state = tmp_path / "export" / "trainer_state.json"
    state.write_text(json.dumps({**json.loads(state.read_text()), "train_batch_size": 2,
                                 "save_steps": 2}))
    _resumed_ends_where(first, tmp_path / "export", tmp_path / "b")


def test_unknown_architecture_and_spec_file(cluster, tmp_path):
    cf, co = cluster
    saved("llama", tmp_path / "in")
    cfg = json.loads((tmp_path / "in" / "config.json").read_text())
    cfg.update(architectures=["MyLlamaForCausalLM"], model_type="myllama")
    (tmp_path / "in" / "config.json").write_text(json.dumps(cfg))
    r = ptcctl(cf, "import", "mine", str(tmp_path / "in"), "--format", "hf", check=False)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "MyLlamaForCausalLM" in r.stderr and "--model-spec" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    spec = tmp_path / "mine.toml"
    ptcctl(cf, "spec", "--model", "llama:layers=2,hidden=64,heads=4,kv_heads=2,vocab=256,"
           "ffn=96,names=hf", "--dtype", "fp32", "--out", str(spec))
    out = json.loads(ptcctl(cf, "import", "mine", str(tmp_path / "in"), "--format", "hf",
                            "--model-spec", str(spec), "--config", "tp=2",
                            "--hosts", "h0:1,h1:1", "--json").stdout)
    assert out["model"] == "spec:mine.toml"
    export_checkpoint(co, "mine", tmp_path / "out", "hf", progress=False)
    same(tensors(tmp_path / "in"), tensors(tmp_path / "out"))
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == cfg


def test_layouts_that_do_not_fit_are_refused(cluster, tmp_path):
    cf, _ = cluster
    from safetensors.torch import save_file

    saved("gpt2", tmp_path / "g")
    sd = tensors(tmp_path / "g")
    sd["transformer.h.0.attn.c_attn.weight"] = sd["transformer.h.0.attn.c_attn.weight"].t() \
        .contiguous()
    save_file(sd, str(tmp_path / "g" / "model.safetensors"), metadata={"format": "pt"})
    r = ptcctl(cf, "import", "bad", str(tmp_path / "g"), "--format", "hf", check=False)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "c_attn.weight is [192, 64], a Linear's [out, in]" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    cases = [
        ("gpt2", {"n_head": 3}, "n_head=3 does not divide n_embd=64"),
        # a config that does not describe the files: transformers' model has other tensors
        ("llama", {"head_dim": 32}, "_proj.weight has shape (32, 64); hf:llama needs (64, 64)"),
        ("llama", {"num_key_value_heads": 3},
         "_proj.weight has shape (32, 64); hf:llama needs (48, 64)"),
        ("llama", {"attention_bias": True}, "lacks tensor model.layers.0.self_attn.q_proj.bias"),
        ("qwen2", {"intermediate_size": 97}, "; hf:qwen2 needs ("),
    ]
    for arch, change, message in cases:
        d = tmp_path / f"{arch}-{next(iter(change))}"
        if not d.exists():
            saved(arch, d)
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(CheckpointError) as e:
            import_checkpoint(cluster[1], "bad", d, "hf", progress=False)
        assert message in str(e.value) and "\n" not in str(e.value), (change, str(e.value))
        shutil.rmtree(d)


def test_gpt2_saved_from_the_base_model_reads_as_hf_does(tmp_path):
    """Old hub GPT-2 files: GPT2Model's names (no ``transformer.``) and the mask
    buffers ``attn.bias``/``attn.masked_bias``."""
    from safetensors.torch import save_file

    from ptcfs.client.formats.io import read_source

    saved("gpt2", tmp_path)
    sd = {k.removeprefix("transformer."): v for k, v in tensors(tmp_path).items()}
    for i in range(2):
        sd[f"h.{i}.attn.bias"] = torch.ones(1, 1, 32, 32)
        sd[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    save_file(sd, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    src = read_source(tmp_path, "hf")
    assert src.spec is not None and sorted(src.tensors) == sorted(
        t.name for t in src.spec.tensors)
    assert torch.equal(src.tensors["transformer.wte.weight"].get(), sd["wte.weight"])
    assert any("attention mask buffers" in n for n in src.notes)
