"""Transport stage: RDMA lowering of messages to RoCEv2 / InfiniBand packets.

* :func:`assign_qps` — verb, destination QPN and UDP source port of each network message;
* :func:`packetize` — messages -> time-ordered chunks of the packets table (segmentation at the
  path MTU, PSNs, ACKs, READ, ECN marks and CNPs);
* :func:`render` — packets -> frame bytes (headers declared once in :mod:`.headers`, ICRC/VCRC in
  :mod:`.icrc`).
"""

from .packetize import packetize
from .qp import assign_qps, udp_sport
from .render import render, render_slots

__all__ = ["assign_qps", "packetize", "render", "render_slots", "udp_sport"]
