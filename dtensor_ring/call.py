"""``RingCall``: one ``ring_attention`` / SDPA call, resolved once.

A call's options are checked and resolved where it enters: ``attention.py`` from the user's
arguments (``ring_attention``, ``simulate_ring``), ``dtensor/handler.py`` from SDPA's and the
registered schedule. What comes out is a frozen ``RingCall``, and everything after reads it: the
eager autograd functions, the simulated ranks, the custom ops' bodies and fake implementations
(``ops.py``, ``hybrid/ops.py``) and the compile pass (``dtensor_ring.passes``). It crosses the
custom op's boundary as the op's arguments: ``op_args`` writes them and ``from_op_args`` reads
them back, the one place that knows their order.
"""
import math
import operator
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch.distributed.distributed_c10d import _resolve_process_group

from .consistency import check as check_consistency
from .documents import documents
from .hybrid.heads import head_split
from .hybrid.schedule import placed_schedule
from .kernels import BlockKernel, kernel_named, resolve_backend
from .layouts.boundaries import Documents
from .layouts.windows import Window, effective_window, from_args, window_args
from .schedules import get_schedule


@dataclass(frozen=True)
class RingCall:
    """Everything a call needs but its tensors, resolved: built by ``resolve`` (from checked
    arguments) or ``from_op_args`` (from a custom op's).

    Packed documents' boundaries (``cu_seqlens``) are a tensor, and stay one: an op input under
    torch.compile (new boundaries are a new input, not a recompile), beside the call, never in
    it. The call holds only their static part, the bound ``max_seqlen``; ``documents(cu)`` makes
    the ``Documents`` the schedules take from the boundaries tensor (``Documents.of``: one object
    per tensor, so the documents a public call checked are the ones found again from its
    boundaries). Keeping the tensor out keeps the call frozen, comparable and free of device state.

    Attributes:
        schedule (str): the schedule's name, a key of ``SCHEDULES`` or ``"auto"``.
        mesh_shape (tuple[int, int]): (ring ranks, all-to-all ranks); (W, 1) on a 1-D mesh.
        is_causal (bool): the causal mask over global positions.
        scale (float): the softmax scale (1 / sqrt(D) when the caller gave none).
        backend (str): the resolved block kernel's name (never ``"auto"``).
        precision (str): ``"fp32"`` or ``"exact"``.
        max_seqlen (int): a bound on the longest document's length; 0 without documents.
        window (Window | None): the sliding window that changes anything (None: no window, or
            one that covers every document: plain attention).
        kernel (BlockKernel): the kernel named ``backend``.
        placed: the schedule object: the named schedule, on a 2-D mesh inside the hybrid's
            (``hybrid/schedule.placed_schedule``); given only by the tests that run a
            deliberately broken schedule.
    """

    schedule: str
    mesh_shape: tuple[int, int]
    is_causal: bool
    scale: float
    backend: str
    precision: str
    max_seqlen: int = 0
    window: Optional[Window] = None
    # Derived from the fields above, once, when the call is made (``__post_init__``).
    kernel: BlockKernel = field(default=None, init=False, compare=False, repr=False)
    placed: object = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        # a frozen dataclass sets its derived fields through object.__setattr__
        object.__setattr__(self, "kernel", kernel_named(self.backend))
        if self.placed is None:
            object.__setattr__(self, "placed", placed_schedule(get_schedule(self.schedule),
                                                               *self.mesh_shape))

    @classmethod
    def resolve(cls, q: torch.Tensor, *, schedule: str, mesh_shape: tuple[int, int],
                is_causal: bool, scale: Optional[float], backend: str, precision: str,
                window: Optional[Window], seq_len: int, cu_seqlens=None,
                max_seqlen: Optional[int] = None) -> tuple:
        """The call of checked arguments (``validation.check_options``, ``check_window``), and
        its documents checked here: the kernel picked, the scale and the window made concrete.

        Args:
            q (torch.Tensor): this rank's queries [B, Hq, S_local, D] (or the whole sequence's,
                simulated): the kernel is picked for their device, dtype and head dim.
            schedule, mesh_shape, is_causal, precision: as the attributes.
            scale (float | None): the softmax scale; None: 1 / sqrt(D).
            backend (str): ``"auto"`` or a kernel's name (``kernels.get_kernel``).
            window (Window | None): the checked window argument.
            seq_len (int): the global sequence length.
            cu_seqlens, max_seqlen: the public call's documents, unchecked
                (``documents.documents``); None: no documents.

        Returns:
            tuple: (the ``RingCall``, its ``Documents`` or None).

        Raises:
            ValueError, TypeError: documents not as ``ring_attention`` describes them; no kernel
                (or not the named one) runs these inputs.
        """
        placed = placed_schedule(get_schedule(schedule), *mesh_shape)
        layout, world = placed.layout, mesh_shape[0] * mesh_shape[1]
        docs = documents(cu_seqlens, max_seqlen, seq_len, layout.document_multiple(world),
                         layout.name, q.device, world_size=layout.placement_world(world))
        window = effective_window(window, is_causal, seq_len if docs is None else docs.max_len)
        # Under torch.compile a head dim seen to change (the same code compiled again) becomes
        # symbolic, which resolve_backend (a constant) cannot take. operator.index makes Dynamo
        # specialise it (a guard on its value); int() and math.trunc leave it symbolic. The
        # documents' bound sizes kernel grids: a constant of the graph too.
        head_dim = operator.index(q.shape[-1])
        name = resolve_backend(backend, q.device, q.dtype, head_dim, precision,
                               docs is not None, window is not None)
        call = cls(schedule=schedule, mesh_shape=tuple(mesh_shape), is_causal=is_causal,
                   scale=1.0 / math.sqrt(head_dim) if scale is None else float(scale),
                   backend=name, precision=precision,
                   max_seqlen=0 if docs is None else operator.index(docs.max_len), window=window,
                   placed=placed)
        return call, docs

    def documents(self, cu_seqlens: Optional[torch.Tensor]) -> Optional[Documents]:
        """The ``Documents`` of the call's boundaries (int32 on the inputs' device, checked), or
        None without documents."""
        return None if cu_seqlens is None else Documents.of(cu_seqlens, self.max_seqlen)

    def check(self, group, q: torch.Tensor, k: torch.Tensor,
              cu_seqlens: Optional[torch.Tensor]) -> None:
        """The ranks' agreement on this call (``consistency.py``), before its first exchange;
        on a 2-D mesh then what only the hybrid needs of the head counts.

        Args:
            group (ProcessGroup): all of the call's ranks (``SequenceMesh.check_group``).
            q, k (torch.Tensor): this rank's query and key shards.
            cu_seqlens (torch.Tensor | None): the documents' boundaries.

        Raises:
            ValueError: on every rank, if the ranks' calls differ; head counts that do not split
                over the all-to-all ranks.
        """
        two_d = self.mesh_shape[1] > 1
        check_consistency(group, q, k, schedule=self.schedule, is_causal=self.is_causal,
                          precision=self.precision, scale=self.scale, cu_seqlens=cu_seqlens,
                          window=self.window, mesh=self.mesh_shape if two_d else None)
        if two_d:
            head_split(q.shape[1], k.shape[1], self.mesh_shape[1])

    def forward(self, comm, q, k, v, docs: Optional[Documents] = None):
        """The schedule's forward on this rank through ``comm``: (out, lse); out is fp32 in
        exact mode (kept for the backward; callers cast it)."""
        return self.placed.forward(comm, q, k, v, is_causal=self.is_causal, scale=self.scale,
                                   kernel=self.kernel, docs=docs, window=self.window)

    def backward(self, comm, dout, q, k, v, out, lse, docs: Optional[Documents] = None):
        """The schedule's backward on this rank through ``comm``: (dq, dk, dv)."""
        return self.placed.backward(comm, dout, q, k, v, out, lse, is_causal=self.is_causal,
                                    scale=self.scale, kernel=self.kernel, docs=docs,
                                    window=self.window)

    def op_args(self, groups: tuple, cu_seqlens: Optional[torch.Tensor]) -> tuple:
        """The custom op's arguments after its tensors (``ops.py``, ``hybrid/ops.py``).

        Args:
            groups (tuple[str, ...]): the process groups by name: the ring's, or on a 2-D mesh
                the ring's, the all-to-all's and the whole mesh's (``SequenceMesh.group_names``).
            cu_seqlens (torch.Tensor | None): the documents' boundaries (``Documents.cu``).

        Returns:
            tuple: ``(*groups, schedule, is_causal, scale, backend, precision, cu_seqlens,
            max_seqlen)``, then on a 1-D mesh the window as two ints (the hybrid's ops take
            none).
        """
        window = window_args(self.window) if len(groups) == 1 else ()
        return (*groups, self.schedule, self.is_causal, self.scale, self.backend, self.precision,
                cu_seqlens, self.max_seqlen, *window)

    @classmethod
    def from_op_args(cls, groups: tuple, schedule: str, is_causal: bool, scale: float,
                     backend: str, precision: str, cu_seqlens, max_seqlen: int,
                     window_left: int = -1, window_right: int = -1) -> tuple:
        """``op_args`` read back: from an op's body, its fake implementation, or a graph node's
        arguments (the compile pass).

        Args:
            groups (tuple[str, ...]): the op's process group names, as ``op_args`` takes them.
            schedule .. window_right: the op's arguments after them; ``cu_seqlens`` as the
                caller holds it (a tensor, or the compile pass's graph node).

        Returns:
            tuple: (the ``RingCall``, ``cu_seqlens`` as given).
        """
        sizes = [_resolve_process_group(name).size() for name in groups[:2]]
        return cls(schedule=schedule, mesh_shape=(sizes[0], sizes[1] if len(sizes) > 1 else 1),
                   is_causal=is_causal, scale=scale, backend=backend, precision=precision,
                   max_seqlen=max_seqlen, window=from_args(window_left, window_right)), cu_seqlens
