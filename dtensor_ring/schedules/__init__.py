"""Schedules = layout + exchange. Registry used by ``ring_attention`` and ``simulate_ring``."""
from ..layouts import CONTIGUOUS, STRIPE, ZIGZAG
from .llama3 import Llama3
from .ring_pass import RingPass

SCHEDULES = {
    "ring": RingPass("ring", CONTIGUOUS),
    "zigzag": RingPass("zigzag", ZIGZAG),
    "stripe": RingPass("stripe", STRIPE),
    "llama3": Llama3(),
}


def get_schedule(name):
    if name not in SCHEDULES:
        raise ValueError(f"schedule={name!r} is not a known schedule; valid schedules: "
                         f"{sorted(SCHEDULES)}")
    return SCHEDULES[name]


__all__ = ["SCHEDULES", "get_schedule"]
