"""Human-readable numbers for command output."""

from __future__ import annotations

__all__ = ["fmt_bytes", "fmt_rate"]


def fmt_bytes(n: float) -> str:
    """``1536`` → ``"1.5 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def fmt_rate(nbytes: float, seconds: float) -> str:
    """Bytes over seconds as GB/s (decimal, as networks are quoted)."""
    return f"{nbytes / seconds / 1e9:.2f} GB/s" if seconds > 0 else "n/a"
