"""NCCL protocol facts: step (slice) sizes, wire overhead, clear-to-send, QPs per connection.

Sources (NVIDIA NCCL):

* ``src/include/device.h``: ``NCCL_STEPS = 8``; Simple buffer 4 MiB (``DEFAULT_BUFFSIZE``,
  ``NCCL_BUFFSIZE``) -> 512 KiB per step; LL buffer ``NCCL_LL_LINES_PER_THREAD (8) x
  NCCL_LL_MAX_NTHREADS (512) x NCCL_STEPS`` 16-byte lines (8 data + 2x4 flag bytes) -> 64 KiB
  on the wire, 32 KiB of data per step; LL128 buffer ``NCCL_LL128_ELEMS_PER_THREAD (120) x
  NCCL_LL128_MAX_NTHREADS (640) x NCCL_STEPS`` 8-byte words, 128-byte lines carrying 120 bytes
  of data (``NCCL_LL128_DATAELEMS = 15`` of 16 words) -> 614,400 wire bytes, 576,000 data bytes
  per step.
* ``src/transport/net_ib.cc``: the receiver posts one clear-to-send per receive (an inline RDMA
  WRITE of one 64-byte ``ncclIbSendFifo`` element into the sender's FIFO); with
  ``NCCL_IB_QPS_PER_CONNECTION = q`` a connection has ``q`` QPs. With
  ``NCCL_IB_SPLIT_DATA_ON_QPS = 0`` (the default since NCCL 2.20) each message goes whole on one
  QP, the QPs taken in turn; with 1, each message is cut into ``q`` pieces of
  ``ceil(ceil(size/q)/128)*128`` bytes, one per QP, every QP ending with a WRITE WITH IMMEDIATE
  even when its piece is empty (``ncclIbMultiSend``).
* ``src/init.cc``: ``NCCL_P2P_NET_CHUNKSIZE`` 128 KiB and ``NCCL_P2P_NVL_CHUNKSIZE`` 512 KiB:
  the slice of point-to-point operations (send/recv, all-to-all) over the network and NVLink
  (NCCL logs it as "P2P Chunksize set to 131072").
"""

from __future__ import annotations

import numpy as np

from ..plan import Plan

CTS_BYTES = 64
"""Bytes of one clear-to-send (one ``ncclIbSendFifo`` element, ``src/transport/net_ib.cc``)."""

QP_SPLIT_ALIGN = 128
"""Alignment of per-QP pieces when data is split on QPs (``ncclIbMultiSend``)."""

STEP_DATA_BYTES = {"simple": 512 * 1024, "ll": 32 * 1024, "ll128": 576_000}
"""Data bytes per step of each protocol with NCCL's default buffers (see module docstring)."""

P2P_NET_CHUNK = 128 * 1024
P2P_NVL_CHUNK = 512 * 1024


def step_bytes(plan: Plan) -> int:
    """Data bytes per step slice: ``collectives.step_bytes`` when the plan sets it, else the protocol's
    default (:data:`STEP_DATA_BYTES`)."""
    raw = plan.raw.get("collectives", {}) if isinstance(plan.raw, dict) else {}
    if "step_bytes" in raw:
        return int(plan.collectives.step_bytes)
    return STEP_DATA_BYTES[plan.collectives.protocol]


def p2p_chunk(plan: Plan, network: np.ndarray) -> np.ndarray:
    """Slice bytes of point-to-point transfers: NCCL's P2P chunk sizes per link, or the plan's
    ``step_bytes`` when set."""
    raw = plan.raw.get("collectives", {}) if isinstance(plan.raw, dict) else {}
    if "step_bytes" in raw:
        return np.full(len(network), int(plan.collectives.step_bytes), dtype=np.int64)
    return np.where(network, P2P_NET_CHUNK, P2P_NVL_CHUNK).astype(np.int64)


def wire_bytes(nbytes: np.ndarray, protocol: str) -> np.ndarray:
    """Bytes a message of ``nbytes`` data occupies with the protocol's framing.

    Simple: unchanged. LL: 16-byte lines of 8 data bytes (two 4-byte data words each with a 4-byte
    flag), ``ceil(n/8) * 16``. LL128: 128-byte lines of 120 data bytes, ``ceil(n/120) * 128``.
    """
    nbytes = np.asarray(nbytes, dtype=np.int64)
    if protocol == "simple":
        return nbytes.copy()
    if protocol == "ll":
        return -(-nbytes // 8) * 16
    if protocol == "ll128":
        return -(-nbytes // 120) * 128
    raise ValueError(f"unknown protocol {protocol!r}")


def data_in_wire(wire: np.ndarray, protocol: str) -> np.ndarray:
    """Data bytes carried by ``wire`` bytes of whole protocol lines (inverse of :func:`wire_bytes`)."""
    wire = np.asarray(wire, dtype=np.int64)
    if protocol == "ll":
        return wire // 2
    if protocol == "ll128":
        return wire // 128 * 120 + np.minimum(wire % 128, 120)
    return wire.copy()
