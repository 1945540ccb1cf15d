"""Collective algorithms lowered to point-to-point messages, as NCCL runs them.

* :func:`lower` — collectives table -> messages columns (``schemas/messages.schema.json``).
* :func:`trace` — the same plus what each message does to the receiver's buffer (symbolic replay).
* :func:`resolve_algorithms` — ``auto`` and inapplicable algorithms resolved like NCCL.
* :func:`ring_orders` — NCCL-style rail-aligned ring orders per channel.
"""

from .lower import lower, trace
from .placement import ring_orders, tree_orders
from .protocol import wire_bytes
from .tuning import resolve_algorithms

__all__ = ["lower", "trace", "resolve_algorithms", "ring_orders", "tree_orders", "wire_bytes"]
