"""Live changes of a running job: survivors keep their processes and tensors.

- :mod:`~ptcfs.client.live.agent`: the launcher (rendezvous on a TCPStore,
  workers and standby workers, generations, lost workers);
- :mod:`~ptcfs.client.live.group`: the process group and DeviceMesh
  re-formed in place;
- :mod:`~ptcfs.client.live.mover`: device-to-device moves on ptcfs's plan;
- :mod:`~ptcfs.client.live.worker`: a worker's training loop that changes
  its mesh when told (:mod:`~ptcfs.client.live.generation`: the
  generations it reads and its record of each change;
  :mod:`~ptcfs.client.live.heal`: where survivors of a failed step go on);
- :mod:`~ptcfs.client.live.durable`: the job kept in ptcfs's stores behind
  the workers (the launcher's ``--job``);
- :mod:`~ptcfs.client.live.hotswitch`: two meshes of the same workers
  within one step;
- :mod:`~ptcfs.client.live.facemover`: the training face's
  ``job.reconfigure`` device to device (``attach(..., mover=LiveMover())``).
"""

from ptcfs.client.live.agent import Launcher
from ptcfs.client.live.facemover import LiveMover
from ptcfs.client.live.mover import MoveStats, device_plan, move, worker_config
from ptcfs.client.live.worker import Change, LiveWorker

__all__ = ["Change", "Launcher", "LiveMover", "LiveWorker", "MoveStats", "device_plan", "move",
           "worker_config"]
