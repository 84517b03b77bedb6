"""How many results one fused merge pass takes: the contract of ``merge.merge_many_`` and
``merge.sum_many_`` and the argument slots of their Triton kernels (``triton_merge.py``). Apart
from both so that ``merge.py`` (which loads ``triton_merge`` only where Triton is installed) and
``triton_merge.py`` read them without importing each other."""

MAX_BLOCKS = 3  # blocks ``merge_many_`` takes: with the first result, four in one pass
MAX_PARTS = 4  # parts ``sum_many_`` takes
