"""The fp32 merge of partial attention results and the fp32 accumulation of block results.

* ``online.py``  the online-softmax merge and the accumulation, one implementation per device kind
                 (and for traced code)
* ``fused.py``   the same as Triton kernels (CUDA; loaded only where Triton is installed)
* ``slots.py``   how many results one fused pass takes
"""
from .online import accumulate_, init_, merge_, merge_many_, sum_many_
from .slots import MAX_BLOCKS, MAX_PARTS

__all__ = ["MAX_BLOCKS", "MAX_PARTS", "accumulate_", "init_", "merge_", "merge_many_",
           "sum_many_"]
