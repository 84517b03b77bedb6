"""FX graph passes for torch.compile (installed as ``dtensor_ring.passes``).

* ``ring_expand.py`` expands ring-attention nodes into the schedule's explicit steps
* ``install.py``     puts it into inductor's custom-pass slot, composed with a user's own pass
"""
from .install import ComposedPass, install, uninstall
from .ring_expand import COUNTERS, RingExpandPass, expand_ring_attention

__all__ = ["COUNTERS", "ComposedPass", "RingExpandPass", "expand_ring_attention", "install",
           "uninstall"]
