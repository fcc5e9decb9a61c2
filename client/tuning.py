"""Tunables of the training-side client, with their defaults.

Each can be set with the ``PTC_*`` environment variable named next to it;
explicit function arguments win over both.
"""

from __future__ import annotations

import os

__all__ = ["STAGING_BYTES", "PROGRESS_MIN_BYTES", "READ_THREADS", "RESUME_TIMEOUT_S",
           "LOCAL_STORE"]

#: Size of each of the two pinned host buffers a load to CUDA streams
#: through (``PTC_CLIENT_STAGING_BYTES``); bigger sub-tensors go in pieces.
STAGING_BYTES = int(os.environ.get("PTC_CLIENT_STAGING_BYTES", 64 << 20))
#: A load or save of at least this many bytes shows a progress bar on a
#: terminal (``PTC_CLIENT_PROGRESS_BYTES``).
PROGRESS_MIN_BYTES = int(os.environ.get("PTC_CLIENT_PROGRESS_BYTES", 256 << 20))
#: Sub-tensors read at once when loading to CPU memory
#: (``PTC_CLIENT_READ_THREADS``).
READ_THREADS = max(1, int(os.environ.get("PTC_CLIENT_READ_THREADS", 4)))
#: How long workers wait for the one that reconfigures the job
#: (``PTC_CLIENT_RESUME_TIMEOUT_S``).
RESUME_TIMEOUT_S = float(os.environ.get("PTC_CLIENT_RESUME_TIMEOUT_S", 600))
#: Read a host's store directly when it is on this machine, instead of through
#: its daemon (``PTC_CLIENT_LOCAL_STORE=0`` turns it off).
LOCAL_STORE = os.environ.get("PTC_CLIENT_LOCAL_STORE", "1") not in ("0", "false", "no")
