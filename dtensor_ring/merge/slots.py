"""How many results one fused merge pass takes: the contract of ``online.merge_many_`` and
``online.sum_many_`` and the argument slots of their Triton kernels (``fused.py``). Apart from both
so that ``online.py`` (which loads ``fused`` only where Triton is installed) and ``fused.py`` read
them without importing each other."""

MAX_BLOCKS = 3  # blocks ``merge_many_`` takes: with the first result, four in one pass
MAX_PARTS = 4  # parts ``sum_many_`` takes
