"""Chakra execution traces (MLCommons Chakra, ``et_def.proto``) and PyTorch host execution traces.

Forms read:

- binary ``.et``: a stream of messages, each preceded by its length as a protobuf varint; the
  first is ``GlobalMetadata``, the rest are ``Node``. wiretrace decodes the protobuf wire format
  itself and declares only the fields it uses (below); unknown fields are skipped.
- the jsonizer's JSON (``chakra_jsonizer``): the same messages as JSON objects written back to
  back (not an array), 64-bit integers as strings, attributes as ``{"name", "int64Val"...}``.
- the older Chakra JSON: ``{"workload_graph": [{"Id", "Name", "NodeType", "is_cpu_op", ...}]}``.
- the PyTorch execution trace (``{"schema": "1.0.2-chakra...", "nodes": [...]}``), the host-side
  input of Chakra's converter: ``record_param_comms`` nodes with positional inputs
  ``[tensors, seq, pg, rank, collective name, in_splits, out_splits, world size]`` (or, in newer
  schemas, named attributes); tensors are ``[id, storage id, offset, numel, itemsize, device]``.

Fields used (Chakra ``et_def.proto``): ``Node`` 1 id, 2 name, 3 type (``NodeType``: 5
COMM_SEND_NODE, 6 COMM_RECV_NODE, 7 COMM_COLL_NODE), 6 start_time_micros, 8 inputs
(``IOInfo`` 3 types: the dtype, e.g. ``Tensor(float)``), 10 attr; ``AttributeProto`` 1 name and its value (3 double, 5 float, 7 int32, 9 int64, 11 uint32,
13 uint64, 15 sint32, 17 sint64, 27 bool, 29 string). Attributes: ``comm_type``
(``CollectiveCommType``: 0 all_reduce, 1 reduce, 2 all_gather, 3 gather, 4 scatter,
5 broadcast, 6 all_to_all, 7 reduce_scatter, 8 reduce_scatter_block, 9 barrier), ``comm_size``
(bytes of the node's input tensors, as Chakra's PyTorch converter computes it: each rank's send
buffer for all_gather, the whole buffer for reduce_scatter), ``is_cpu_op``, ``pg_name``,
``comm_src``/``comm_dst``/``comm_tag``.

CPU-side nodes (``is_cpu_op`` true) carry no traffic and are counted, not read. A node without
a size becomes a row with bytes -1 and dtype ``unknown`` and is listed in
``report["unknown_sizes"]``. The group size is not part of a Chakra node: it comes from
``world_size`` (argument), the older JSON's ``ngpus``, or the PyTorch trace's world size; else -1.
"""

from __future__ import annotations

import ast
import re
import struct
from collections import defaultdict
from pathlib import Path

from .common import UNKNOWN, Partial, Skip, counts_by_op, json_values, read_bytes, sizes

NODE_TYPES = {0: "INVALID_NODE", 1: "METADATA_NODE", 2: "MEM_LOAD_NODE", 3: "MEM_STORE_NODE",
              4: "COMP_NODE", 5: "COMM_SEND_NODE", 6: "COMM_RECV_NODE", 7: "COMM_COLL_NODE"}
COMM_TYPES = {0: "all_reduce", 1: "reduce", 2: "all_gather", 3: "gather", 4: "scatter", 5: "broadcast",
              6: "all_to_all", 7: "reduce_scatter", 8: "reduce_scatter", 9: "barrier"}
_NAME_OPS = (("allreduce", "all_reduce"), ("reducescatter", "reduce_scatter"), ("allgather", "all_gather"),
             ("alltoall", "all_to_all"), ("broadcast", "broadcast"), ("reduce", "reduce"))
_TENSOR_DTYPES = {"float": "fp32", "float32": "fp32", "double": "fp64", "float64": "fp64", "half": "fp16",
                  "float16": "fp16", "c10::half": "fp16", "c10::bfloat16": "bf16", "bfloat16": "bf16",
                  "long int": "int64", "long": "int64", "int64": "int64", "int": "int32", "int32": "int32",
                  "signed char": "int8", "int8": "int8", "unsigned char": "uint8", "uint8": "uint8",
                  "bool": "uint8"}

# Varint-typed AttributeProto value fields: number -> decoder.
_ATTR_VARINT = {7: "int32", 9: "int64", 11: "uint32", 13: "uint64", 15: "sint32", 17: "sint64", 27: "bool"}


# ---------------------------------------------------------------------------------------------
# protobuf wire format (https://protobuf.dev/programming-guides/encoding/)
# ---------------------------------------------------------------------------------------------

class WireError(ValueError):
    """Bytes that are not valid protobuf wire format."""


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    result, shift = 0, 0
    while True:
        if pos >= len(buf):
            raise WireError("varint runs past the end of the message")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise WireError("varint longer than 10 bytes")


def fields(buf: bytes):
    """Yield ``(field number, wire type, value)`` of one message: ints for varints, bytes for
    length-delimited fields, raw 8/4 bytes for fixed64/fixed32."""
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        num, wt = key >> 3, key & 7
        if num == 0:
            raise WireError("field number 0")
        if wt == 0:
            val, pos = _varint(buf, pos)
        elif wt == 2:
            n, pos = _varint(buf, pos)
            if pos + n > len(buf):
                raise WireError("length-delimited field runs past the end of the message")
            val, pos = buf[pos:pos + n], pos + n
        elif wt == 1:
            if pos + 8 > len(buf):
                raise WireError("fixed64 runs past the end")
            val, pos = buf[pos:pos + 8], pos + 8
        elif wt == 5:
            if pos + 4 > len(buf):
                raise WireError("fixed32 runs past the end")
            val, pos = buf[pos:pos + 4], pos + 4
        else:
            raise WireError(f"wire type {wt} is not used by proto3")
        yield num, wt, val


def _signed64(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def _attr(buf: bytes) -> tuple[str, object]:
    name, value = "", None
    for num, wt, val in fields(buf):
        if num == 1 and wt == 2:
            name = val.decode("utf-8", errors="replace")
        elif wt == 0 and num in _ATTR_VARINT:
            kind = _ATTR_VARINT[num]
            if kind == "bool":
                value = bool(val)
            elif kind in ("int64", "int32"):
                value = _signed64(val)
            elif kind in ("sint32", "sint64"):
                value = (val >> 1) ^ -(val & 1)
            else:
                value = val
        elif num == 29 and wt == 2:
            value = val.decode("utf-8", errors="replace")
        elif num == 3 and wt == 1:
            value = struct.unpack("<d", val)[0]
        elif num == 5 and wt == 5:
            value = struct.unpack("<f", val)[0]
    return name, value


def _node_from_proto(buf: bytes) -> dict:
    node = {"id": None, "name": "", "type": None, "attrs": {}, "start_us": None}
    for num, wt, val in fields(buf):
        if num == 1 and wt == 0:
            node["id"] = val
        elif num == 2 and wt == 2:
            node["name"] = val.decode("utf-8", errors="replace")
        elif num == 3 and wt == 0:
            node["type"] = NODE_TYPES.get(val, str(val))
        elif num == 6 and wt == 0:
            node["start_us"] = val
        elif num == 8 and wt == 2:
            for n2, w2, v2 in fields(val):
                if n2 == 3 and w2 == 2:
                    node["types"] = v2.decode("utf-8", errors="replace")
        elif num == 10 and wt == 2:
            k, v = _attr(val)
            node["attrs"][k] = v
    return node


def looks_like_binary(data: bytes) -> bool:
    """True when ``data`` starts with two length-prefixed protobuf messages (GlobalMetadata, Node)."""
    try:
        n, pos = _varint(data, 0)
        if n == 0 or pos + n > len(data):
            return False
        first = list(fields(data[pos:pos + n]))
        if not first or any(wt not in (0, 2) for _, wt, _ in first):
            return False
        pos += n
        if pos >= len(data):
            return True
        n, pos = _varint(data, pos)
        if pos + n > len(data):
            return n > 0  # a file cut off inside its first node
        return bool(list(fields(data[pos:pos + n])))
    except WireError:
        return False


def looks_like_json(text: str) -> bool:
    """True for the Chakra JSON forms and the PyTorch execution trace."""
    return bool(re.search(r'"workload_graph"|"COMM_COLL_NODE"|"COMP_NODE"|"METADATA_NODE"|"COMM_SEND_NODE"'
                          r'|"name"\s*:\s*"schema"|"pytorch\|profiler\|execution_trace', text)) or \
        ('"nodes"' in text and '"schema"' in text)


def _read_binary(data: bytes, fname: str, skipped: list[Skip]) -> list[dict]:
    nodes, pos, index = [], 0, 0
    while pos < len(data):
        start = pos
        try:
            n, pos = _varint(data, pos)
        except WireError:
            skipped.append(Skip(fname, f"byte {start}", "file ends inside a message length (cut off)"))
            break
        if pos + n > len(data):
            skipped.append(Skip(fname, f"byte {start}", f"message {index} needs {n} bytes but the file ends "
                                                        f"after {len(data) - pos} (cut off)"))
            break
        msg = data[pos:pos + n]
        pos += n
        try:
            if index == 0 and not _is_node(msg):
                index += 1
                continue  # GlobalMetadata
            node = _node_from_proto(msg)
        except WireError as e:
            skipped.append(Skip(fname, f"byte {start}", f"message {index} is not valid protobuf ({e})"))
            index += 1
            continue
        node["source"] = f"{fname}:node {node['id']}"
        nodes.append(node)
        index += 1
    return nodes


def _is_node(msg: bytes) -> bool:
    """GlobalMetadata has no varint field 1 (its field 1 is the version string)."""
    for num, wt, _ in fields(msg):
        if num == 1:
            return wt == 0
    return False


# ---------------------------------------------------------------------------------------------
# JSON forms
# ---------------------------------------------------------------------------------------------

def _json_attr_value(a: dict):
    for k, v in a.items():
        if k == "name":
            continue
        if k.endswith("Val"):
            if k == "boolVal":
                return bool(v)
            if k == "stringVal":
                return v
            if k in ("doubleVal", "floatVal"):
                return float(v)
            return int(v)
        if k.endswith("List") and isinstance(v, dict):
            return v.get("values", [])
    return None


def _node_from_jsonizer(obj: dict, fname: str) -> dict:
    attrs = {a["name"]: _json_attr_value(a) for a in obj.get("attr", []) if isinstance(a, dict) and "name" in a}
    start = obj.get("startTimeMicros")
    return {"id": int(obj["id"]) if "id" in obj else None, "name": obj.get("name", ""),
            "type": obj.get("type"), "attrs": attrs, "types": (obj.get("inputs") or {}).get("types", ""), "start_us": int(start) if start is not None else None,
            "source": f"{fname}:node {obj.get('id')}"}


def _read_json_stream(text: str, fname: str, skipped: list[Skip]) -> list[dict]:
    objs, cut = json_values(text, 0, str.isspace)
    if cut is not None:
        skipped.append(Skip(fname, cut[0], f"JSON object {len(objs)} is cut off or damaged ({cut[1]}); "
                                           f"read the {len(objs)} objects before it"))
    return objs


def _nodes_from_json(text: str, fname: str, skipped: list[Skip], ctx: dict) -> list[dict]:
    objs = _read_json_stream(text, fname, skipped)
    nodes: list[dict] = []
    for obj in objs:
        if not isinstance(obj, dict):
            continue
        if "workload_graph" in obj:                       # older Chakra JSON
            ctx["world"] = ctx.get("world") or obj.get("ngpus")
            for n in obj["workload_graph"]:
                nodes.append({"id": n.get("Id"), "name": n.get("Name", ""),
                              "type": NODE_TYPES.get(n.get("NodeType"), str(n.get("NodeType"))),
                              "attrs": {k: v for k, v in n.items() if k not in ("Id", "Name", "NodeType")},
                              "start_us": None, "source": f"{fname}:node {n.get('Id')}"})
        elif "nodes" in obj and isinstance(obj["nodes"], list):   # PyTorch execution trace
            ctx["pytorch_et"] = True
            nodes += [{"pt": n, "source": f"{fname}:node {n.get('id')}"} for n in obj["nodes"] if isinstance(n, dict)]
        elif "type" in obj or "id" in obj:                 # jsonizer node
            nodes.append(_node_from_jsonizer(obj, fname))
    return nodes


# ---------------------------------------------------------------------------------------------
# nodes -> rows
# ---------------------------------------------------------------------------------------------

def read(paths: list[Path], world_size: int | None = None) -> Partial:
    """Read Chakra traces (one per rank; ``NAME.<rank>.et`` / ``.json`` names give the rank).

    Parameters
    ----------
    paths : ``.et`` or JSON files (gzip accepted).
    world_size : ranks in the collectives' group when the trace does not say.

    Returns
    -------
    Partial : one row per GPU communication node (``source`` ``file:node ID``); CPU-side nodes
        are counted in ``report["chakra_cpu_nodes"]``.
    """
    out = Partial("chakra")
    cpu_nodes = 0
    items = []
    p2p = defaultdict(lambda: {"send": [], "recv": []})
    for fidx, path in enumerate(paths):
        fname = str(path)
        data = read_bytes(path, out.skipped)
        m = re.search(r"\.(\d+)\.(?:et|json)(?:\.gz)?$", Path(fname).name)
        rank = int(m.group(1)) if m else fidx
        ctx: dict = {"world": world_size}
        if data.lstrip()[:1] in (b"{", b"["):
            nodes = _nodes_from_json(data.decode("utf-8", errors="replace"), fname, out.skipped, ctx)
        else:
            nodes = _read_binary(data, fname, out.skipped)
        out.files.append({"path": fname, "format": "chakra", "nodes": len(nodes)})
        starts = [n["start_us"] for n in nodes if n.get("start_us")]
        t0 = min(starts) if starts else None
        for node in nodes:
            if "pt" in node:
                row = _pytorch_et_row(node, fname, out)
                if row is not None:
                    items.append(((fidx, len(items)), row))
                continue
            kind = node.get("type")
            if kind not in ("COMM_COLL_NODE", "COMM_SEND_NODE", "COMM_RECV_NODE"):
                continue
            if node["attrs"].get("is_cpu_op") is True:
                cpu_nodes += 1
                continue
            t_ns = (node["start_us"] - t0) * 1000 if t0 is not None and node.get("start_us") else 0
            if kind == "COMM_COLL_NODE":
                row = _coll_row(node, ctx.get("world"), out)
                if row is not None:
                    row["t_ready_ns"] = t_ns
                    items.append(((fidx, len(items)), row))
            else:
                a = node["attrs"]
                src = a.get("comm_src", rank if kind == "COMM_SEND_NODE" else None)
                dst = a.get("comm_dst", rank if kind == "COMM_RECV_NODE" else None)
                size = a.get("comm_size")
                if src is None or dst is None:
                    out.skipped.append(Skip(fname, f"node {node['id']}", f"{kind} without comm_src/comm_dst"))
                    continue
                if size is None:
                    out.unknown_sizes.append({"source": node["source"], "reason": f"{kind} has no comm_size"})
                half = "send" if kind == "COMM_SEND_NODE" else "recv"
                p2p[(int(src), int(dst), size, a.get("comm_tag"))][half].append((fidx, len(items), node, t_ns))
    for (src, dst, size, _tag), sides in p2p.items():
        for k in range(max(len(sides["send"]), len(sides["recv"]))):
            pair = [x for x in (sides["send"][k] if k < len(sides["send"]) else None,
                                sides["recv"][k] if k < len(sides["recv"]) else None) if x]
            fidx, pos, node, t_ns = pair[0]
            nbytes = int(size) if size is not None else UNKNOWN
            items.append(((fidx, pos), dict(op="send_recv", group=0, ranks=[src, dst], group_size=2,
                                            bytes_global=nbytes, bytes_per_rank=nbytes, src=src, dst=dst,
                                            t_ready_ns=t_ns, source=node["source"])))
    items.sort(key=lambda it: it[0])
    groups: dict[str, int] = {}
    info: dict[int, dict] = {}
    for _, row in items:
        pg = row.pop("pg", "")
        g = groups.setdefault(pg, len(groups))
        info.setdefault(g, {"group": g, "name": pg, "size": row["group_size"], "calls": 0})["calls"] += 1
        row["group"] = g
        out.rows.add(**row)
    out.communicators = list(info.values())
    out.report["chakra_cpu_nodes"] = cpu_nodes
    out.report["counts"] = counts_by_op([r["op"] for _, r in items])
    return out


def _op_from_name(name: str) -> str | None:
    flat = name.lower().replace("_", "")
    for key, op in _NAME_OPS:
        if key in flat:
            return op
    return None


def _coll_row(node: dict, world: int | None, out: Partial) -> dict | None:
    a = node["attrs"]
    ct = a.get("comm_type")
    op = COMM_TYPES.get(int(ct)) if ct is not None else _op_from_name(node["name"])
    where = node["source"]
    if op is None:
        out.skipped.append(Skip(where.rsplit(":node", 1)[0], f"node {node['id']}",
                                f"COMM_COLL_NODE {node['name'][:40]!r} has no comm_type and names no collective"))
        return None
    if op in ("gather", "scatter", "barrier"):
        out.skipped.append(Skip(where.rsplit(":node", 1)[0], f"node {node['id']}",
                                f"{op} is not an operation of the collectives table"))
        return None
    n = int(world) if world else UNKNOWN
    size = a.get("comm_size")
    if size is None:
        out.unknown_sizes.append({"source": where, "reason": f"{op} node {node['id']} has no comm_size"})
        bg = bpr = UNKNOWN
    else:
        size = int(size)
        if op == "reduce_scatter":
            bg, bpr = size, (size // n if n > 0 else UNKNOWN)
        else:
            bg, bpr = sizes(op, 1, size, n)
    dtype = "unknown"
    m = re.search(r"Tensor\(([^)]*)\)", str(node.get("types", "")))
    if m and size is not None:
        dtype = _TENSOR_DTYPES.get(m.group(1).strip().lower(), "unknown")
    return dict(op=op, ranks=list(range(n)) if n > 0 else [], group_size=n, bytes_global=bg,
                bytes_per_rank=bpr, dtype=dtype, pg=str(a.get("pg_name", "")), source=where, group=0)


def _literal(v):
    if isinstance(v, str):
        try:
            return ast.literal_eval(v)
        except (ValueError, SyntaxError):
            return v
    return v


def _pytorch_et_row(node: dict, fname: str, out: Partial) -> dict | None:
    """A ``record_param_comms`` node of a PyTorch execution trace (host side)."""
    pt = node["pt"]
    if pt.get("name") != "record_param_comms":
        return None
    attrs = {a.get("name"): a.get("value") for a in pt.get("attrs", []) if isinstance(a, dict)}
    inputs = pt.get("inputs", {})
    values = _literal(inputs.get("values", []))
    types = _literal(inputs.get("types", []))
    if not isinstance(values, list):
        values = []
    if "collective_name" in attrs:
        name = attrs["collective_name"]
        world = attrs.get("pg_size") or attrs.get("group_size")
        tensors = values[0] if values else []
        ttype = types[0] if types else ""
    else:
        idx = next((i for i, v in enumerate(values) if isinstance(v, str) and not v.startswith("<")), None)
        if idx is None:
            out.skipped.append(Skip(fname, f"node {pt.get('id')}", "record_param_comms without a collective name"))
            return None
        name = values[idx]
        world = values[idx + 3] if len(values) > idx + 3 and isinstance(values[idx + 3], int) else None
        tensors = values[0] if idx > 0 else []
        ttype = types[0] if types else ""
    from .kineto import normalize_op
    op = normalize_op(str(name))
    if op is None:
        if str(name).lower() not in ("wait", "barrier"):
            out.skipped.append(Skip(fname, f"node {pt.get('id')}", f"collective {name!r} is not an operation of "
                                                                   f"the collectives table"))
        return None
    if op in ("send", "recv"):
        out.skipped.append(Skip(fname, f"node {pt.get('id')}", f"{op}: the execution trace does not name the peer"))
        return None
    flat = _tensors(tensors)
    m = re.search(r"Tensor\(([^)]*)\)", str(ttype))
    dtype = _TENSOR_DTYPES.get(m.group(1).strip().lower(), "unknown") if m else "unknown"
    n = int(world) if world else UNKNOWN
    if not flat:
        out.unknown_sizes.append({"source": node["source"], "reason": f"{op}: no input tensor recorded"})
        bg = bpr = UNKNOWN
        dtype = "unknown"
    else:
        numel = sum(t[3] for t in flat)
        esz = flat[0][4]
        if op == "reduce_scatter":
            bg, bpr = numel * esz, (numel * esz // n if n > 0 else UNKNOWN)
        else:
            bg, bpr = sizes(op, esz, numel, n)
    return dict(op=op, ranks=list(range(n)) if n > 0 else [], group_size=n, bytes_global=bg, bytes_per_rank=bpr,
                dtype=dtype, pg=str(attrs.get("pg_name", "")), source=node["source"], group=0)


def _tensors(v) -> list[list]:
    """Tensor tuples ``[id, storage, offset, numel, itemsize, device]`` nested anywhere in ``v``."""
    if isinstance(v, list) and len(v) == 6 and all(isinstance(x, int) for x in v[:5]) and isinstance(v[5], str):
        return [v]
    if isinstance(v, list):
        return [t for x in v for t in _tensors(x)]
    return []
