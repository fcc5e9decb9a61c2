"""ptcfs for a training script, in one import::

    import ptcfs.client.torch as ptc

    job = ptc.attach("llama", model, optimizer, mesh)  # created, resumed or reconfigured
    data = job.data(file="tokens.npy", batch=12, seed=1)
    for step in range(job.step, steps):
        loss = train(model, data.rows(step))
        if (step + 1) % 5 == 0:
            job.save(step + 1)
    job.close()

:func:`attach` takes a module on a DeviceMesh (FSDP2, tensor parallelism,
pipeline stages; its spec derived from the module); :func:`start` a preset
model whose mesh ptcfs picks. The :class:`Job` handle loads, saves
(``save(step)``), moves the job to another mesh (``reconfigure``) and
reads the dataset (``data``, ``position``). :func:`load_into` and
:func:`state_of` move one rank's state between a module and ptcfs, for
code that is not a torchrun job. Everything is collective over the
default process group (a process without one is a job of one rank).
torch is needed (``pip install 'ptcfs[torch]'``).
"""

from ptcfs.client.torch.elastic import POLICIES
from ptcfs.client.torch.job import Attached, Job, attach, connect, start
from ptcfs.client.torch.module import load_into, state_of
from ptcfs.errors import WorkerError

__all__ = ["POLICIES", "Attached", "Job", "WorkerError", "attach", "connect", "load_into",
           "start", "state_of"]
