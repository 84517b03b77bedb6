"""``Documents``: one call's packed-document boundaries as the layouts, kernels and schedules take
them (``documents.py`` checks a public call's ``cu_seqlens`` and builds it)."""
import torch
from torch._subclasses.fake_tensor import is_fake


class Documents:
    """One call's documents: ``cu`` (int32, [N + 1], on the compute device) and ``max_len`` (an
    upper bound on the longest document, host int). Layouts keep the device tensors they derive
    in ``cached`` (built once, reused by every ring step and by the backward).

    ``Documents.of(cu, max_len)`` reuses one object per boundaries tensor: ``ContextParallel``
    passes the same tensor to every attention layer of a forward, so the per-step segments are
    derived once per batch, not once per layer (a dozen small kernels and their host time
    each). Not while a CUDA graph is captured or traced: a captured graph must derive them from
    the boundaries the tensor holds at each replay, so a capture also drops the ``host`` values
    (the placement's exact form would copy them to the device, which a capture refuses, and a
    replay with other boundaries would reuse them)."""

    def __init__(self, cu: torch.Tensor, max_len: int, host: list[int] | None = None):
        self.cu, self.max_len = cu, max_len
        self.host = host  # the boundaries as ints, where they were read without a device sync
        self._cache: dict = {}

    @classmethod
    def of(cls, cu: torch.Tensor, max_len: int, host: list[int] | None = None) -> "Documents":
        if is_traced(cu) or not isinstance(max_len, int):
            return cls(cu, max_len, host)
        if capturing(cu.device):
            return cls(cu, max_len)
        key = (max_len, cu._version)
        held = getattr(cu, "_dtensor_ring_documents", None)
        if held is None or held[0] != key:
            if host is None and held is not None and held[0][1] == cu._version:
                host = held[1].host  # the same values, another bound (ContextParallel's bucket)
            held = (key, cls(cu, max_len, host))
            cu._dtensor_ring_documents = held
        return held[1]

    def cached(self, key, make):
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]


def is_traced(x: torch.Tensor) -> bool:
    """Values unknown (Dynamo or a fake tensor); Dynamo must not reach ``is_fake``."""
    return torch.compiler.is_compiling() or is_fake(x)


def capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on ``device``'s current stream: what is derived
    from a tensor then must be derived at every replay, not kept (``Documents.of``)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()
