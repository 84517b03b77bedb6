"""Flag words in GPU memory that a stream sets, or waits for, through the CUDA driver's stream
memory operations (``cuStreamWriteValue32`` / ``cuStreamWaitValue32``).

Why not a kernel: the stream's front end carries these out, with no SM. A running cuDNN
attention kernel holds every SM, so a kernel that waits for a peer (symmetric memory's barrier)
can start only as that kernel drains: a ring shift then lands late (docs/design.md, "The ring
shift on the copy engines"). A stream memory operation waits beside the running kernel.

The address may be in this GPU's memory or in a peer's (symmetric memory maps the peers'
buffers into this process). ``set_flag`` puts a memory barrier before its write, so whatever the
stream wrote before it (a copy into a peer's buffer) is visible to whoever sees the flag set.
"""
import ctypes
from typing import Optional

_WAIT_EQUAL = 0x1  # CU_STREAM_WAIT_VALUE_EQ
_WRITE_AFTER_BARRIER = 0x0  # CU_STREAM_WRITE_VALUE_DEFAULT: a memory barrier, then the write
_driver = None


def _functions():
    global _driver
    if _driver is None:
        lib = ctypes.CDLL("libcuda.so.1")
        args = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        _driver = (lib.cuStreamWaitValue32_v2, lib.cuStreamWriteValue32_v2)
        for function in _driver:
            function.argtypes, function.restype = args, ctypes.c_int
    return _driver


def _check(name: str, result: int) -> None:
    if result != 0:
        raise RuntimeError(f"{name} failed: CUresult {result}")


def wait_flag(stream, address: int, value: int) -> None:
    """Work queued on ``stream`` after this waits until the word at ``address`` equals ``value``."""
    wait, _ = _functions()
    _check("cuStreamWaitValue32", wait(stream.cuda_stream, address, value, _WAIT_EQUAL))


def set_flag(stream, address: int, value: int) -> None:
    """``stream`` writes ``value`` to the word at ``address`` once its earlier work is done and
    visible."""
    _, write = _functions()
    _check("cuStreamWriteValue32", write(stream.cuda_stream, address, value,
                                         _WRITE_AFTER_BARRIER))


def unusable_because() -> Optional[str]:
    """None where a stream can set and wait for a flag on this process's current GPU; else why not
    (no driver library, or the driver refuses stream memory operations)."""
    import torch  # noqa: PLC0415 (the comm package imports without CUDA)
    try:
        _functions()
        word = torch.zeros(1, dtype=torch.int32, device="cuda")
        stream = torch.cuda.current_stream()
        set_flag(stream, word.data_ptr(), 7)
        wait_flag(stream, word.data_ptr(), 7)
        stream.synchronize()
    except (OSError, AttributeError, RuntimeError) as error:
        return str(error)
    return None if word.item() == 7 else "the flag was not written"
