"""The fp32 merge of partial attention results and the fp32 accumulation of block results.

* ``online.py``  the online-softmax merge and the accumulation, one implementation per device kind
* ``fused.py``   the same as Triton kernels (CUDA; loaded only where Triton is installed)
* ``traced.py``  the merge of traced code: one custom op around the device's implementation
* ``slots.py``   how many results one fused pass takes
"""
from .online import accumulate_, init_, merge_, merge_many_, sum_many_
from . import traced  # noqa: F401 - registers dtensor_ring::merged, which compiled code calls
from .slots import MAX_BLOCKS, MAX_PARTS

__all__ = ["MAX_BLOCKS", "MAX_PARTS", "accumulate_", "init_", "merge_", "merge_many_",
           "sum_many_"]
