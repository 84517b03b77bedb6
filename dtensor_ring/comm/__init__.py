"""Communication: what the schedules exchange, and the four ways it is carried out.

* ``base.py``           the ``Communicator`` protocol the schedules are written against
* ``process_group.py``  ``ProcessGroupComm`` on a process group (gloo, NCCL), and ``TRAFFIC``
* ``traced.py``         ``TracedComm``: its exchanges as post/wait custom ops, for the compile pass
* ``simulated.py``      ``SimWorld`` / ``SimMesh``: W ranks as threads of one process
* ``replay.py``         ``ReplayComm``: one rank alone, ready buffers for its peers' messages
* ``mesh.py``           the user's ``mesh`` argument as process groups (``SequenceMesh``)

The hybrid's all-to-all and its pair of communicators are ``hybrid/comm.py``.
"""
from .base import Communicator, Pending, sum_in_rank_order
from .process_group import TRAFFIC, ProcessGroupComm

__all__ = ["Communicator", "Pending", "ProcessGroupComm", "TRAFFIC", "sum_in_rank_order"]
