"""The memory model's pipeline terms against torch.distributed.pipelining
itself (the runtime torchtitan trains with): two gloo ranks run one step of
its interleaved 1F1B schedule, two chunks each, and report the receive
buffers their stages keep and the order of their backwards and gradient
reductions. :func:`~ptcfs.suggest.memory.activation_bytes` counts a buffer
per micro-batch for each chunk's input (but the model's first) and output
gradient (but the model's last); :func:`~ptcfs.suggest.search.estimate`
keeps one chunk's gradients whole at a time in one round of micro-batches
(``m < 2·pp``), every chunk's across rounds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ptcfs.model.presets import parse_model
from ptcfs.suggest import Device, Query
from ptcfs.suggest.memory import StateClasses, activation_bytes, dims_of
from ptcfs.suggest.search import estimate
from ptcfs.types import Host, ParallelConfig

PP, CHUNKS, MICRO, SEQ, HIDDEN = 2, 2, 1, 4, 8


def _worker(rank: int, store_path: str, out_dir: str, rounds: tuple[int, ...]) -> None:
    """One rank: stages ``rank`` and ``rank + PP`` of a chain of linear
    layers; for each ``m`` in ``rounds``, one step, then what the stages and
    the schedule hold, to ``out_dir/<rank>.json``."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, PP), rank=rank,
                            world_size=PP)
    try:
        result = {}
        for m in rounds:
            torch.manual_seed(0)
            stages = [PipelineStage(torch.nn.Linear(HIDDEN, HIDDEN), s, PP * CHUNKS,
                                    torch.device("cpu"))
                      for s in range(rank, PP * CHUNKS, PP)]
            schedule = ScheduleInterleaved1F1B(stages, m, loss_fn=lambda y, t: (y - t).pow(2).sum())
            batch = torch.randn(m * MICRO, SEQ, HIDDEN)
            if rank == 0:
                schedule.step(batch)
            else:
                schedule.step(target=torch.zeros_like(batch))
            result[m] = {
                "buffers": {s.stage_index: {
                    "inputs": [list(i.buffer.shape) for infos in s.args_recv_info.values()
                               for i in infos if getattr(i, "buffer", None) is not None],
                    "grads": [list(i.buffer.shape) for infos in s.grad_recv_info.values()
                              for i in infos if getattr(i, "buffer", None) is not None]}
                    for s in stages},
                "order": [(a.stage_index, str(a.computation_type))
                          for a in schedule.pipeline_order_with_comms[rank]
                          if "BACKWARD" in str(a.computation_type) or
                          "REDUCE_GRAD" in str(a.computation_type)]}
        Path(out_dir, f"{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def pipelined(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    """rank → m → what the ranks reported, for one round (m = PP) and two."""
    import multiprocessing

    out = tmp_path_factory.mktemp("pipelining")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed.pipelining"])
    procs = [ctx.Process(target=_worker, args=(r, str(out / "store"), str(out), (PP, 2 * PP)),
                         daemon=True) for r in range(PP)]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
            assert p.exitcode == 0, f"rank exited {p.exitcode}"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    return {r: {int(m): v for m, v in json.loads((out / f"{r}.json").read_text()).items()}
            for r in range(PP)}


def _model_buffers(m: int) -> list[float]:
    """Each stage's receive buffers by the model, in activations of one micro-batch."""
    model = parse_model(f"llama:layers={PP * CHUNKS},hidden={HIDDEN},heads=2,kv_heads=2,"
                        f"vocab=16,ffn=16", dtype="bf16", optimizer="adam")
    dims = dims_of(model, SEQ)
    assert dims is not None
    cfg = ParallelConfig(1, PP, 1, (Host("h0", PP),), vpp=CHUNKS)
    one = 2 * MICRO * SEQ * HIDDEN
    acts = activation_bytes(dims, cfg, MICRO, m, "full", recv_buffers=True)
    inflight = [a["layers"] / (CHUNKS * 2 * MICRO * SEQ * HIDDEN) for a in acts]
    # the buffers of inputs in flight are counted in "layers": add them back
    return [a["recv_buffers"] / one + (CHUNKS - (i == 0)) * min(m, inflight[i])
            for i, a in enumerate(acts)]


@pytest.mark.parametrize("m", [PP, 2 * PP])
def test_each_chunk_keeps_a_receive_buffer_per_micro_batch(
        pipelined: dict[int, dict], m: int) -> None:
    model = _model_buffers(m)
    for rank in range(PP):
        stages = pipelined[rank][m]["buffers"]
        shapes = [s for st in stages.values() for s in st["inputs"] + st["grads"]]
        assert all(s == [MICRO, SEQ, HIDDEN] for s in shapes), shapes
        for s, st in stages.items():
            first, last = int(s) == 0, int(s) == PP * CHUNKS - 1
            assert (len(st["inputs"]), len(st["grads"])) == (0 if first else m, 0 if last else m)
        assert len(shapes) == pytest.approx(model[rank])


def test_one_round_reduces_each_chunk_before_the_next_chunks_backward(
        pipelined: dict[int, dict]) -> None:
    """With m = pp every backward of a rank's later chunk, then its gradients'
    reduction, come before its earlier chunk's first backward; with two
    rounds the chunks' backwards alternate, and every chunk's gradients are
    whole until the last round."""
    for rank in range(PP):
        late, early = rank + PP, rank
        one = pipelined[rank][PP]["order"]
        stages = [s for s, _ in one]
        reduced = next(i for i, (s, t) in enumerate(one) if s == late and "REDUCE" in t)
        assert reduced < stages.index(early), one
        two = pipelined[rank][2 * PP]["order"]
        reduced = next(i for i, (s, t) in enumerate(two) if s == late and "REDUCE" in t)
        assert reduced > [s for s, _ in two].index(early), two


def test_the_estimate_keeps_one_chunk_s_gradients_whole_in_one_round() -> None:
    """torchtitan's 405B mesh (tp=8, pp=8, fsdp=8): with two chunks and one
    round the whole gradients are half 1F1B's; with two rounds all of them."""
    model = parse_model("llama:layers=126,hidden=16384,heads=128,kv_heads=8,vocab=128256,"
                        "ffn=53248", dtype="bf16", optimizer="adam")
    hosts = tuple(Host(f"h{i}", 8) for i in range(64))
    dev = Device("h100", 96 * 10**9, 989e12, 450e9, 50e9)
    q = Query(model, hosts, 256, 8192, dev, micro=4, recompute="full", cp_shard=1,
              pp_microbatches="stages")
    classes = StateClasses(model)
    one_f_one_b, interleaved = (estimate(q, ParallelConfig(8, 8, 1, hosts, 8, vpp=v), classes)
                                for v in (1, 2))
    whole = one_f_one_b.memory_terms["fsdp_unsharded_grads"]
    assert interleaved.memory_terms["fsdp_unsharded_grads"] == pytest.approx(whole / 2, rel=0.05)
    q2 = Query(model, hosts, 512, 8192, dev, micro=4, recompute="full", cp_shard=1)
    two_rounds = estimate(q2, ParallelConfig(8, 8, 1, hosts, 8, vpp=2), classes)
    assert two_rounds.memory_terms["fsdp_unsharded_grads"] == pytest.approx(whole)
