"""Flag words in GPU memory that a stream sets, or waits for, through the CUDA driver's stream
memory operations (``cuStreamBatchMemOp``: waits and writes of 32-bit words).

Why not a kernel: the stream's front end carries these out, with no SM. A running cuDNN
attention kernel holds every SM, so a kernel that waits for a peer (symmetric memory's barrier)
can start only as that kernel drains: a ring shift then lands late (docs/design.md, "Where the
time goes on real ranks"). A stream memory operation waits beside the running kernel.

The address may be in this GPU's memory or in a peer's (symmetric memory maps the peers'
buffers into this process). A write comes after a memory barrier, so whatever the stream wrote
before it (a copy into a peer's buffer) is visible to whoever sees the flag set.

Why batches: an exchange with W - 1 peers waits for and sets 4 (W - 1) words; one driver call
per word cost host time before the step's compute could be queued (docs/design.md, "Where the
time goes on real ranks": llama3's eager forward lost 1 ms to it). A ``Batch`` is built once, for
fixed addresses, and queued in one call.
"""
import ctypes
from typing import Optional

WAIT, SET = "wait", "set"  # a Batch's operations

_WAIT_VALUE_32, _WRITE_VALUE_32 = 1, 2  # CU_STREAM_MEM_OP_WAIT_VALUE_32, .._WRITE_VALUE_32
_WAIT_EQUAL = 0x1  # CU_STREAM_WAIT_VALUE_EQ
_WRITE_AFTER_BARRIER = 0x0  # CU_STREAM_WRITE_VALUE_DEFAULT: a memory barrier, then the write


class _WaitOrWrite(ctypes.Structure):  # CUstreamMemOpWaitValueParams_st / ..WriteValueParams_st
    _fields_ = [("operation", ctypes.c_uint32), ("address", ctypes.c_uint64),
                ("value", ctypes.c_uint64), ("flags", ctypes.c_uint32), ("alias", ctypes.c_uint64)]


class _Params(ctypes.Union):  # CUstreamBatchMemOpParams: 48 bytes
    _fields_ = [("op", _WaitOrWrite), ("pad", ctypes.c_uint64 * 6)]


_batch_mem_op = None


def _function():
    global _batch_mem_op
    if _batch_mem_op is None:
        function = ctypes.CDLL("libcuda.so.1").cuStreamBatchMemOp_v2
        function.argtypes = [ctypes.c_void_p, ctypes.c_uint, ctypes.POINTER(_Params), ctypes.c_uint]
        function.restype = ctypes.c_int
        _batch_mem_op = function
    return _batch_mem_op


class Batch:
    """Stream memory operations on 32-bit words, queued in order by one driver call:
    ``(WAIT, address, value)``: the stream's later work waits until the word equals ``value``;
    ``(SET, address, value)``: the stream writes ``value`` once its earlier work is done and
    visible."""

    def __init__(self, operations):
        self._count = len(operations)
        self._params = (_Params * self._count)()
        for params, (kind, address, value) in zip(self._params, operations):
            if kind not in (WAIT, SET):
                raise ValueError(f"operation {kind!r} is not valid; valid: {WAIT!r}, {SET!r}")
            params.op.operation = _WAIT_VALUE_32 if kind == WAIT else _WRITE_VALUE_32
            params.op.address, params.op.value = address, value
            params.op.flags = _WAIT_EQUAL if kind == WAIT else _WRITE_AFTER_BARRIER
        self._function = _function()

    def post(self, stream) -> None:
        result = self._function(stream.cuda_stream, self._count, self._params, 0)
        if result != 0:
            raise RuntimeError(f"cuStreamBatchMemOp failed: CUresult {result}")


def unusable_because() -> Optional[str]:
    """None where a stream can set and wait for a flag on this process's current GPU; else why not
    (no driver library, or the driver refuses stream memory operations)."""
    import torch  # noqa: PLC0415 (the comm package imports without CUDA)
    try:
        _function()  # the driver first: without it there is no GPU to ask
        word = torch.zeros(2, dtype=torch.int32, device="cuda")
        stream = torch.cuda.current_stream()
        first, second = word[0].data_ptr(), word[1].data_ptr()
        Batch([(SET, first, 7), (WAIT, first, 7), (SET, second, 9)]).post(stream)
        stream.synchronize()
    except (OSError, AttributeError, RuntimeError) as error:
        return str(error)
    return None if word.tolist() == [7, 9] else "the flags were not written"
