"""ptcfs for a training script, in one import::

    import ptcfs.client.torch as ptc

    job = ptc.attach("llama", model, optimizer, mesh)  # created, resumed or reconfigured
    data = job.data(file="tokens.npy", batch=12, seed=1)
    for step in range(job.step, steps):
        loss = train(model, data.rows(step))
        if (step + 1) % 5 == 0:
            job.save(step + 1)  # returns once copied; committed in the background
    job.close()                 # waits for the last save (job.wait() waits at any point)

:func:`attach` takes a module on a DeviceMesh (FSDP2, tensor parallelism,
pipeline stages; its spec derived from the module); :func:`start` a preset
model whose mesh ptcfs picks. The :class:`Job` handle loads, saves
(``save(step)``, in the background unless ``background=False``;
``wait()``), moves the job to another mesh (``reconfigure``) and reads
the dataset (``data``, ``position``). :func:`load_into` and
:func:`state_of` move one rank's state between a module and ptcfs, for
code that is not a torchrun job. Everything is collective over the
default process group (a process without one is a job of one rank).
torch is needed (``pip install 'ptcfs[torch]'``).

The names load on first use: the package's lower-level modules (``state``,
``module``, ``dtensor_spec``, ...), which the checkpoint formats and the
command line import, do not pull the face (and the control side it
drives) in with them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ptcfs.client.torch.elastic import POLICIES
    from ptcfs.client.torch.entry import attach, start
    from ptcfs.client.torch.job import Attached, Job, connect
    from ptcfs.client.torch.module import load_into, state_of
    from ptcfs.errors import WorkerError

#: Each name of the face → the module that defines it.
_WHERE = {
    "Attached": "ptcfs.client.torch.job",
    "Job": "ptcfs.client.torch.job",
    "attach": "ptcfs.client.torch.entry",
    "connect": "ptcfs.client.torch.job",
    "start": "ptcfs.client.torch.entry",
    "load_into": "ptcfs.client.torch.module",
    "state_of": "ptcfs.client.torch.module",
    "POLICIES": "ptcfs.client.torch.elastic",
    "WorkerError": "ptcfs.errors",
}

__all__ = ["POLICIES", "Attached", "Job", "WorkerError", "attach", "connect", "load_into",
           "start", "state_of"]


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(where), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
