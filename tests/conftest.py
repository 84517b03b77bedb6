"""Session set-up shared by every test module.

Without a GPU the Triton kernels (``kernels/triton_attention.py``, ``merge/fused.py``) run under
Triton's interpreter. ``TRITON_INTERPRET`` must be set before ``triton`` is first imported, since
Triton's own library functions (``tl.zeros``, ...) are compiled or interpreted from that moment on,
and ``import dtensor_ring`` imports it (through torch's inductor) in whichever test module comes
first. Setting it here, before any test module is imported, keeps the interpreted tests independent
of test order.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
