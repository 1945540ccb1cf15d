"""Input/output: capture writers (pcap, pcapng, ERF), capture reading, Parquet tables."""


def write_capture(*args, **kwargs):
    """Write packets as pcap / pcapng / ERF; see :func:`wiretrace.io.write.write_capture`."""
    from .write import write_capture as _write_capture

    return _write_capture(*args, **kwargs)
