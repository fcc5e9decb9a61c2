"""The ``op`` recompute mode against torchtitan's own selective (per-op)
activation checkpointing: its ``SelectiveAC`` wraps the blocks of its own
Llama 3 model (fused query/key/value projection, SwiGLU; its SDPA attention,
which has a backward on CPU, in place of flex), and
the matrix multiplications a backward runs again are what
:func:`~ptcfs.suggest.steptime.step_flops` prices for ``op``; attention's
kernels are among the ops it saves, so ``op`` does not recompute attention."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ptcfs.model.presets import parse_model
from ptcfs.suggest.memory import dims_of, layer_matmuls, token_layer_elements
from ptcfs.suggest.steptime import step_flops

pytest.importorskip("torchtitan")

from tests.titan_job import DIM, FFN, HEADS, KV_HEADS, LAYERS, VOCAB, model_config  # noqa: E402

BATCH, SEQ = 2, 16


class _Matmuls(TorchDispatchMode):
    """Counts ``aten.mm`` calls by their weight's shape, per phase."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "forward"
        self.seen: dict[str, Counter[tuple[int, ...]]] = {"forward": Counter(),
                                                         "backward": Counter()}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        if func is torch.ops.aten.mm.default:
            self.seen[self.phase][tuple(args[1].shape)] += 1
        return func(*args, **(kwargs or {}))


def _backward_matmuls(ac: bool) -> Counter[tuple[int, ...]]:
    from torchtitan.distributed.activation_checkpoint import SelectiveAC
    from torchtitan.models.common.attention import ScaledDotProductAttention

    torch.manual_seed(0)
    model = model_config("llama3").build()
    model.init_weights(buffer_device=torch.device("cpu"))
    for block in model.layers.children():  # SDPA has a backward on CPU, flex does not
        block.attention.inner_attention = ScaledDotProductAttention(
            ScaledDotProductAttention.Config())
    if ac:
        SelectiveAC(SelectiveAC.Config()).apply(model)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
    count = _Matmuls()
    with count:
        loss = model(tokens).float().pow(2).mean()
        count.phase = "backward"
        loss.backward()
    return count.seen["backward"]


def test_op_recomputes_what_torchtitans_selective_checkpointing_recomputes() -> None:
    with_ac, without = _backward_matmuls(True), _backward_matmuls(False)
    again = with_ac - without  # the forward's matrix multiplications run again
    assert without - with_ac == Counter()
    spec = parse_model(f"llama:layers={LAYERS},hidden={DIM},heads={HEADS},"
                       f"kv_heads={KV_HEADS},vocab={VOCAB},ffn={FFN}",
                       dtype="bf16", optimizer="adam")
    dims = dims_of(spec, SEQ)
    assert dims is not None
    tokens = BATCH * SEQ
    # each recomputed product: tokens x (in x out) multiply-adds
    flops = 2 * tokens * sum(shape[0] * shape[1] * n for shape, n in again.items())
    assert flops == step_flops(0.0, dims, BATCH, SEQ, "op")["recompute_dense"]
    assert sum(again.values()) == LAYERS * 2  # the attention output's and the up projection
    assert sum(again.values()) == LAYERS * len(layer_matmuls(dims)[1::2])


def test_op_keeps_attention_and_half_the_matmuls() -> None:
    """torchtitan saves its GPU attention kernels' outputs, so ``op`` keeps
    attention's output and does not run attention again; it keeps less than
    Megatron-style ``selective`` (the up projection's output is recomputed)
    and more than ``full``."""
    from torchtitan.distributed.activation_checkpoint import SelectiveAC

    saved = {str(op) for op in SelectiveAC(SelectiveAC.Config()).get_save_ops()}
    assert {"aten._scaled_dot_product_flash_attention.default",
            "aten._scaled_dot_product_efficient_attention.default",
            "aten._scaled_dot_product_cudnn_attention.default"} <= saved
    spec = parse_model("llama:layers=32,hidden=4096,heads=32,kv_heads=8,vocab=128256,"
                       "ffn=14336", dtype="bf16", optimizer="adam")
    dims = dims_of(spec, 8192)
    assert dims is not None
    sizes = [token_layer_elements(dims, r, 8192) for r in ("full", "op", "selective")]
    assert sizes == sorted(sizes)
    fl = step_flops(6e9, dims, 1, 8192, "op")
    assert 0 < fl["recompute_dense"] < fl["dense"] / 6  # a part of one forward's matrices
    assert fl["recompute_attention"] == 0
