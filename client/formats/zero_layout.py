"""The file names of a DeepSpeed checkpoint, and where its ZeRO keeps each
parameter's fp32 master and Adam moments in the per-rank flat partitions
(the layout of :mod:`ptcfs.client.formats.zero`, no I/O).

ZeRO-1 and -2 (``stage_1_and_2.py``): the parameters of an optimizer group
are flattened one after another (in the group's order, without alignment
padding between them unless ``parameter_alignment`` is on), the flat
buffer is padded with zeros to a multiple of ``2 * dp`` elements and cut
into ``dp`` equal partitions; rank ``r`` keeps partition ``r``. Its
``single_partition_of_fp32_groups`` is saved without the padding, its Adam
moments with it (``group_paddings`` says how much a rank holds).

ZeRO-3 (``stage3.py``): every parameter is partitioned on its own, into
``dp`` parts of ``ceil(numel / dp)`` elements (the last one padded); a rank's
flat fp32 buffer of a sub-group is its part of each parameter, one after
another. A group's parameters form sub-groups of at least
``sub_group_size`` local elements (the last one smaller).

Each ZeRO-1/2 rank file also says, per group, where each parameter's piece
lies in that rank's partition (``param_slice_mappings``: name →
``fragment_address(numel, start)``, only the parameters that reach into it):
DeepSpeed's ``ds_to_universal`` cuts the partitions by it.
"""

from __future__ import annotations

import torch

from ptcfs.errors import CheckpointError

__all__ = ["PARAM", "LATEST", "model_name", "optim_name", "layer_name", "LAYER_FILE", "ALIGN",
           "partition_size", "split_flat", "fragments", "lean", "paddings", "join_flat", "part3",
           "split3", "join3", "sub_groups"]

#: the spec parameter that records the DeepSpeed settings of a job
PARAM = "deepspeed"
#: the file in a checkpoint directory that names the tag to load
LATEST = "latest"

#: ZeRO-1/2 pad a group's flat buffer to a multiple of ``ALIGN * dp`` elements
#: (``nccl_start_alignment_factor``)
ALIGN = 2


def model_name(dp_rank: int | None, mp: int = 0) -> str:
    """The model-states file of ZeRO-1/2 (``None``) or of ZeRO-3 rank
    ``dp_rank``; ``mp``: the model-parallel rank (a pipeline's stage)."""
    return (f"mp_rank_{mp:02d}_model_states.pt" if dp_rank is None
            else f"zero_pp_rank_{dp_rank}_mp_rank_{mp:02d}_model_states.pt")


def optim_name(dp_rank: int, bf16: bool, mp: int = 0) -> str:
    """Rank ``dp_rank``'s optimizer-states file (of pipeline stage ``mp``)."""
    return f"{'bf16_' if bf16 else ''}zero_pp_rank_{dp_rank}_mp_rank_{mp:02d}_optim_states.pt"


#: a PipelineModule layer's file (``ckpt_layer_path`` without tensor parallelism)
LAYER_FILE = r"layer_(\d+)-model_states\.pt"


def layer_name(layer: int) -> str:
    """The file of a ``PipelineModule``'s layer ``layer`` (its global index)."""
    return f"layer_{layer:02d}-model_states.pt"


def partition_size(numel: int, dp: int) -> int:
    """Elements of each rank's partition of a ZeRO-1/2 group of ``numel``."""
    step = ALIGN * dp
    return -(-numel // step) * step // dp


def split_flat(flat: torch.Tensor, dp: int) -> list[torch.Tensor]:
    """The ``dp`` padded partitions of a group's flat buffer."""
    part = partition_size(flat.numel(), dp)
    padded = torch.zeros(part * dp, dtype=flat.dtype)
    padded[:flat.numel()] = flat
    return [padded[r * part:(r + 1) * part].clone() for r in range(dp)]


def fragments(numels: list[int], dp: int) -> list[list[tuple[int, int, int]]]:
    """Each rank's pieces of a ZeRO-1/2 group of parameters ``numels`` (laid
    one after another): ``(parameter index, start in the rank's partition,
    elements)``, for the parameters that reach into that partition."""
    part = partition_size(sum(numels), dp)
    out: list[list[tuple[int, int, int]]] = [[] for _ in range(dp)]
    offset = 0
    for i, n in enumerate(numels):
        for r in range(dp):
            lo, hi = max(offset, r * part), min(offset + n, (r + 1) * part)
            if lo < hi:
                out[r].append((i, lo - r * part, hi - lo))
        offset += n
    return out


def paddings(numel: int, dp: int) -> list[int]:
    """How many padding elements each rank's partition holds."""
    part = partition_size(numel, dp)
    return [min(part, max(0, (r + 1) * part - numel)) for r in range(dp)]


def lean(parts: list[torch.Tensor], numel: int) -> list[torch.Tensor]:
    """Each partition without its padding (as ``single_partition_of_fp32_groups``)."""
    pads = paddings(numel, len(parts))
    return [p[:p.numel() - pad] for p, pad in zip(parts, pads, strict=True)]


def join_flat(parts: list[torch.Tensor], pads: list[int], numel: int, where: str
              ) -> torch.Tensor:
    """A group's flat buffer of ``numel`` from its partitions, each holding
    ``pads[r]`` elements of padding at its end."""
    flat = torch.cat([p.reshape(-1)[:p.numel() - pad] for p, pad in zip(parts, pads,
                                                                        strict=True)])
    if flat.numel() < numel:
        raise CheckpointError(f"{where}: the partitions hold {flat.numel()} elements, the "
                              f"group's parameters {numel}")
    return flat[:numel]


def part3(numel: int, dp: int) -> int:
    """Elements of each rank's ZeRO-3 partition of a parameter of ``numel``."""
    return -(-numel // dp)


def split3(flats: list[torch.Tensor], dp: int) -> list[torch.Tensor]:
    """Each rank's flat buffer of a ZeRO-3 sub-group of parameters ``flats``."""
    out: list[list[torch.Tensor]] = [[] for _ in range(dp)]
    for f in flats:
        n = part3(f.numel(), dp)
        padded = torch.zeros(n * dp, dtype=f.dtype)
        padded[:f.numel()] = f
        for r in range(dp):
            out[r].append(padded[r * n:(r + 1) * n])
    return [torch.cat(o) if o else torch.zeros(0) for o in out]


def join3(ranks: list[torch.Tensor], numels: list[int], where: str) -> list[torch.Tensor]:
    """The flat parameters ``numels`` from every rank's ZeRO-3 buffer (all
    its sub-groups, one after another)."""
    dp = len(ranks)
    out, offset = [], 0
    for n in numels:
        k = part3(n, dp)
        if offset + k > min(r.numel() for r in ranks):
                raise CheckpointError(f"{where}: the ranks' partitions end before the parameters "
                                  f"do ({offset + k} elements needed)")
        out.append(torch.cat([r[offset:offset + k] for r in ranks])[:n])
        offset += k
    return out


def sub_groups(numels: list[int], dp: int, size: int) -> list[list[int]]:
    """The positions of a group's parameters in each ZeRO-3 sub-group."""
    if sum(part3(n, dp) for n in numels) <= size:
        return [list(range(len(numels)))]
    out: list[list[int]] = []
    cur: list[int] = []
    local = 0
    for i, n in enumerate(numels):
        cur.append(i)
        local += part3(n, dp)
        if local >= size or i == len(numels) - 1:
            out.append(cur)
            cur, local = [], 0
    return out
