"""FX graph passes (installed as ``dtensor_ring.passes``); the compile pass lands with issue 4."""
