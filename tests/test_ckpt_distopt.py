"""The distributed optimizer's ``distrib_optim.pt`` in legacy Megatron-LM
checkpoints: its flat layout against megatron-core's own gradient buffer
(``_ParamAndGradBuffer``, built on CPU), and a checkpoint with it imported,
reconfigured and exported, tensor by tensor.

The files are laid out here as ``get_parameter_state_dp_zero`` does, from
the offsets of megatron-core's buffer (not from ptcfs's code): each
bucket's unpadded part, buckets one after the other. The buffer allocates
its storage on ``torch.cuda.current_device()``, stubbed to the CPU.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core", reason="megatron-core is not installed "
                    "(pip install 'ptcfs[mcore]')")

from ptcfs.client.formats.megatron_distopt import buffer_layout  # noqa: E402
from ptcfs.client.torch.state import to_numpy  # noqa: E402
from tests.test_ckpt_mcore import mcore  # noqa: E402,F401
from tests.test_client_ckpt import (  # noqa: E402,F401 - cluster, trained: fixtures
    cluster,
    flat,
    megatron_shards,
    model_chunks,
    same_models,
    trained,
    write_megatron_dir,
)
from tests.test_cluster import ptcctl  # noqa: E402

pytestmark = [pytest.mark.multihost, pytest.mark.slow,
              pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]


@pytest.fixture
def cpu_buffers(mcore, monkeypatch):  # noqa: F811
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")


def megatron_offsets(tensors, bucket_size=None, shared=()):
    """megatron-core's flat offsets of ``tensors`` (registration order) and
    the buffer's unpadded length, as ``get_parameter_state_dp_zero`` packs it."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBuffer
    from megatron.core.process_groups_config import ProcessGroupCollection

    groups = ProcessGroupCollection()  # 0.16.1 has no default for these
    groups.tp = parallel_state.get_tensor_model_parallel_group()
    groups.dp_cp = parallel_state.get_data_parallel_group(with_context_parallel=True)
    params = [torch.nn.Parameter(t.detach().clone()) for t in tensors]
    for p, s in zip(params, shared or [False] * len(params)):
        p.shared_embedding = s
    buf = _ParamAndGradBuffer(
        DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True),
        params[0].dtype, torch.float32, params, parallel_state.get_data_parallel_group(),
        bucket_size, {p: f"p{i}" for i, p in enumerate(params)}, 1.0,
        list(range(len(params))), False, groups)
    starts = [0]
    for b in buf.buckets:
        starts.append(starts[-1] + b.numel_unpadded)
    out = []
    for p in params:
        begin, _, bucket = buf.param_index_map[p]
        out.append(starts[bucket] + begin - buf.bucket_indices[bucket][0])
    return out, buf.numel_unpadded


@pytest.mark.parametrize("bucket_size", [None, 700, 3000])
@pytest.mark.parametrize("shared", ["none", "first", "last"])
def test_buffer_layout_is_megatron_cores(cpu_buffers, bucket_size, shared):
    sizes = [(50, 7), (13,), (64, 3), (100,), (7, 7), (1,), (300, 2), (65,)]
    tensors = [torch.zeros(s) for s in sizes]
    flags = {"none": [], "first": [True] + [False] * 7, "last": [False] * 7 + [True]}[shared]
    offsets, total = megatron_offsets(tensors, bucket_size, flags)
    # ptcfs takes the parameters in buffer order: reverse registration
    ours, our_total = buffer_layout([t.numel() for t in tensors][::-1], bucket_size, flags[::-1])
    assert (ours[::-1], our_total) == (offsets, total)


def with_distrib_optim(shards, pp, bucket_size=None):
    """Turn each rank's Adam entry into DistributedOptimizer.state_dict's entry;
    gives each rank's ``distrib_optim.pt`` (laid out by megatron-core's buffer):
    a buffer per model chunk (one per virtual stage), in chunk order, buckets
    only in the first stage's first chunk."""
    files = {}
    for (t, p), sd in shards.items():
        # Megatron's names, made unique across chunks (each numbers its layers from 0)
        chunks = [{f"{v}:{n}": x for n, x in flat(c).items()}
                  for v, c in enumerate(model_chunks(sd))]
        tensors = {n: x for c in chunks for n, x in c.items()}
        names = list(tensors)
        opt = sd["optimizer"]
        masters = opt.get("fp32_from_fp16_params") if "optimizer" in opt else None
        adam = opt["optimizer"] if masters is not None else opt
        groups = [[n for n in names if tensors[n].dim() >= 2],
                  [n for n in names if tensors[n].dim() < 2]]
        state, master = {}, {}
        for g, (ids, group) in enumerate(zip([g["params"] for g in adam["param_groups"]],
                                             groups)):
            for j, (i, n) in enumerate(zip(ids, group)):
                state[n] = adam["state"][i]
                master[n] = masters[g][j] if masters is not None else tensors[n]
        files[(t, p)] = {"buckets_coalesced": True}
        for v, chunk in enumerate(chunks):
            shared = [pp > 1 and ("word_embeddings" in n) for n in chunk]
            offsets, total = megatron_offsets(list(chunk.values()),
                                              bucket_size if (p, v) == (0, 0) else None, shared)
            world = {k: torch.zeros(total) for k in ("param", "exp_avg", "exp_avg_sq")}
            for n, at in zip(chunk, offsets):
                k = tensors[n].numel()
                world["param"][at:at + k] = master[n].reshape(-1).float()
                for kind in ("exp_avg", "exp_avg_sq"):
                    world[kind][at:at + k] = state[n][kind].reshape(-1)
            world["numel_unpadded"] = total
            dtype = next(iter(chunk.values())).dtype
            files[(t, p)][v] = {(dtype, torch.float32): world}
        sd["optimizer"] = {"optimizer": {"param_groups": [
            {k: v for k, v in g.items() if k != "params"} for g in adam["param_groups"]]}}
        if bucket_size:
            sd["args"].overlap_grad_reduce, sd["args"].ddp_bucket_size = True, bucket_size
    return files


@pytest.mark.parametrize("vpp", [1, 2])
def test_distributed_optimizer_round_trip(cpu_buffers, cluster, trained,  # noqa: F811
                                          tmp_path, vpp):
    """bf16 parameters, tp=2 pp=2 (with two virtual stages each: a buffer
    per model chunk), buckets of 3000 elements on the first stage's first
    chunk: imported per parameter, reconfigured, exported with one bucket
    per buffer (Megatron-LM without --overlap-grad-reduce), byte for byte."""
    cf, co = cluster
    m, opt = trained
    shards = megatron_shards(m, tp=2, pp=2, vocab_size=True, opt=opt, dtype=torch.bfloat16,
                             vpp=vpp)
    files = with_distrib_optim(shards, 2, bucket_size=3000)
    write_megatron_dir(tmp_path / "meg", shards, pp=2)
    for (t, p), state in files.items():
        torch.save(state, tmp_path / "meg" / "iter_0000002" / f"mp_rank_{t:02d}_{p:03d}" /
                   "distrib_optim.pt")
    job = f"dopt{vpp}"
    out = json.loads(ptcctl(cf, "import", job, str(tmp_path / "meg"), "--format", "megatron",
                            "--config", "tp=1,dp=2,zero=1", "--hosts", "h0:1,h1:1",
                            "--json").stdout)
    assert (out["dtype"], out["optimizer"], out["notes"]) == ("bf16", "adam", [])
    st = co.state(job)
    for n, p in m.named_parameters():
        got = torch.from_numpy(co.fetch_tensor(st, n).view(np.int16)).view(torch.bfloat16)
        assert torch.equal(got, p.detach().to(torch.bfloat16)), n
        np.testing.assert_array_equal(co.fetch_tensor(st, f"optim/master/{n}"), to_numpy(p))
        for kind in ("exp_avg", "exp_avg_sq"):
            np.testing.assert_array_equal(co.fetch_tensor(st, f"optim/{kind}/{n}"),
                                          to_numpy(opt.state[p][kind]), err_msg=f"{kind} {n}")
    ptcctl(cf, "reconfigure", job, "--to", f"tp=2,pp=2,vpp={vpp},zero=1", "--hosts",
           "h0:2,h1:2")
    ptcctl(cf, "export", job, str(tmp_path / "back"), "--format", "megatron")
    want = megatron_shards(m, tp=2, pp=2, vocab_size=True, opt=opt, dtype=torch.bfloat16,
                           vpp=vpp)
    files = with_distrib_optim(want, 2)
    for (t, p), sd in want.items():
        d = f"iter_0000002/mp_rank_{t:02d}_{p:03d}"
        got = torch.load(tmp_path / "back" / d / "model_optim_rng.pt", weights_only=False)
        assert got["args"].use_distributed_optimizer
        assert set(got["optimizer"]) == {"optimizer"}
        assert "state" not in got["optimizer"]["optimizer"]
        assert same_models(sd, got), (t, p)
        wd = files[(t, p)]
        gd = torch.load(tmp_path / "back" / d / "distrib_optim.pt", weights_only=False)
        assert gd["buckets_coalesced"] and list(gd) == list(wd), (t, p)
        for v in range(vpp):
            assert list(gd[v]) == list(wd[v]), (t, p, v)
            ((_, ww),), ((_, gw),) = wd[v].items(), gd[v].items()
            assert ww["numel_unpadded"] == gw["numel_unpadded"]
            for kind in ("param", "exp_avg", "exp_avg_sq"):
                assert torch.equal(ww[kind], gw[kind]), (t, p, v, kind)
