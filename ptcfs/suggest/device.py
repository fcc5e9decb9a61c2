"""The device a mesh runs on: GPU memory, throughput and the two links.

A :class:`Device` is given by its numbers or by a named profile
(:data:`PROFILES`). Bandwidths are per GPU and one direction: ``intra_host``
is what one GPU reaches of the others in its host (NVLink), ``inter_host``
what one GPU reaches of another host (its NIC, as on hosts with one NIC per
GPU). Beyond ``pod_gpus`` GPUs the network is oversubscribed
``pod_oversubscription`` times: Llama 3's RoCE fabric (Dubey et al., 2024,
§3.3.1) gives full bisection bandwidth within a pod of 3,072 GPUs and 1:7
between pods, the defaults. ``hbm`` is the GPU's memory bandwidth.
``attn_util`` is the share of the peak that causal attention kernels
(FlashAttention-style, counted as they run: half the scores, the backward
forming them again) reach on long blocks; 0.34 by default, what this
model priced attention at before it counted the kernels' work.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ptcfs.errors import InvalidConfig

__all__ = ["Device", "PROFILES", "parse_rate", "parse_bytes", "device_from"]


@dataclass(frozen=True)
class Device:
    """One GPU and its links: bytes, FLOP/s, bytes/s."""

    name: str
    memory: int
    flops: float
    intra_host: float
    inter_host: float
    pod_gpus: int = 3072
    pod_oversubscription: float = 7.0
    hbm: float = 3.35e12
    attn_util: float = 0.34


#: Named devices (dense bf16 peak; memory as the GPU reports it).
PROFILES: dict[str, Device] = {
    "h100-sxm": Device("h100-sxm", 80 << 30, 989e12, 450e9, 50e9, hbm=3.35e12),
    "a100-80gb": Device("a100-80gb", 80 << 30, 312e12, 600e9, 25e9, hbm=2.0e12),
    "a100-40gb": Device("a100-40gb", 40 << 30, 312e12, 600e9, 25e9, hbm=1.55e12),
}

_NUM = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?)(b|bit)?\s*", re.IGNORECASE)
_SCALE = " kmgtp"


def _number(text: str, what: str, example: str) -> tuple[float, str]:
    m = _NUM.fullmatch(text)
    if m is None:
        raise InvalidConfig(f"bad {what} {text!r}: expected e.g. {example}")
    value, prefix, binary, unit = m.groups()
    base = 1024 if binary else 1000
    return float(value) * base ** _SCALE.index(prefix.lower() or " "), unit or ""


def parse_bytes(text: str) -> int:
    """``"80GiB"`` → 85899345920, ``"80GB"`` → 8e10."""
    n, _ = _number(text, "memory size", "80GiB or 40GB")
    if n <= 0:
        raise InvalidConfig(f"memory size {text!r} must be above 0")
    return int(n)


def parse_rate(text: str) -> float:
    """``"450GB/s"`` → 4.5e11 bytes/s; ``"200Gb/s"`` (bits) → 2.5e10."""
    body, slash, per = text.strip().partition("/")
    if slash and per.strip().lower() != "s":
        raise InvalidConfig(f"bad bandwidth {text!r}: expected e.g. 450GB/s or 200Gb/s")
    n, unit = _number(body, "bandwidth", "450GB/s or 200Gb/s")
    if unit == "b" or unit.lower() == "bit":
        n /= 8
    if n <= 0:
        raise InvalidConfig(f"bandwidth {text!r} must be above 0")
    return n


def device_from(profile: str | None = None, memory: str | None = None,
                tflops: float | None = None, intra_host: str | None = None,
                inter_host: str | None = None) -> Device:
    """A profile, with any of its numbers replaced; without a profile every
    number must be given."""
    if profile is not None and profile not in PROFILES:
        raise InvalidConfig(f"unknown device profile {profile!r}; known: {', '.join(PROFILES)}")
    base = PROFILES.get(profile or "")
    given = {"--gpu-mem": memory, "--gpu-tflops": tflops, "--intra-host": intra_host,
             "--inter-host": inter_host}
    if base is None:
        missing = [k for k, v in given.items() if v is None]
        if missing:
            raise InvalidConfig(f"describe the GPU: give --device {'|'.join(PROFILES)} or "
                                f"{', '.join(missing)}")
        base = Device("custom", 0, 0.0, 0.0, 0.0)
    if tflops is not None and tflops <= 0:
        raise InvalidConfig(f"--gpu-tflops {tflops} must be above 0")
    return Device(
        base.name if all(v is None for v in given.values()) else f"{base.name}*",
        parse_bytes(memory) if memory is not None else base.memory,
        tflops * 1e12 if tflops is not None else base.flops,
        parse_rate(intra_host) if intra_host is not None else base.intra_host,
        parse_rate(inter_host) if inter_host is not None else base.inter_host,
        base.pod_gpus, base.pod_oversubscription, base.hbm, base.attn_util,
    )
