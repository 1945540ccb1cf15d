"""wiretrace: what one iteration of distributed LLM training puts on the wire.

The pipeline (see ``DESIGN.md`` in the shared design notes and README.md) runs in one direction::

    plan -> workload -> collectives -> timing -> transport -> io
    measured log/trace -> ingest --^

Each stage is a function from one table to the next; the tables are declared in ``schemas/``.
"""

__version__ = "0.1.0"
