"""Write a learnable synthetic token data set: ``[samples, seq+1]`` int32.

Each sample follows ``x[t+1] = (a * x[t] + c) mod vocab`` with ``a`` and
``c`` drawn per sample from a few choices, so a small GPT's loss falls
quickly. ``python examples/make_tokens.py OUT.npy [--samples N] [--seq S]
[--vocab V] [--seed K]``.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np


def tokens(samples: int, seq: int, vocab: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    a = rng.choice([1, 3, 5, 7], size=samples)
    c = rng.integers(1, 4, size=samples)
    out = np.empty((samples, seq + 1), dtype=np.int32)
    out[:, 0] = rng.integers(0, vocab, size=samples)
    for t in range(seq):
        out[:, t + 1] = (a * out[:, t] + c) % vocab
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--samples", type=int, default=600)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    np.save(a.out, tokens(a.samples, a.seq, a.vocab, a.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
