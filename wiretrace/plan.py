"""The plan file: load, validate against ``schemas/plan.schema.json``, fill defaults, check numbers.

A plan describes one training iteration (model, batch, parallelism, cluster, collective library,
transport). :func:`load` returns a frozen :class:`Plan`; every rate and duration string is parsed
once here into bits/s, bytes/s or ns.

Errors are :class:`~wiretrace.errors.PlanError` with one line naming the JSON path and what was
expected, or the numbers that disagree (for example ``tp*pp*dp*cp = 16 but nodes*gpus_per_node =
32``).
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import jsonschema

from .errors import PlanError
from .models import ModelConfig, resolve as resolve_model
from .tables import schema_dir

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "fp64": 8, "int8": 1, "uint8": 1,
               "int32": 4, "uint32": 4, "int64": 8, "uint64": 8, "unknown": 0}
"""Bytes per element of each dtype name used in the tables."""

_SI = {"": 1, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
_BIN = {"B": 1, "KB": 1000, "MB": 1000**2, "GB": 1000**3, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3}
_TIME = {"ns": 1, "us": 1e3, "µs": 1e3, "ms": 1e6, "s": 1e9}


def parse_rate(text: str, where: str = "rate") -> float:
    """Parse ``"400Gbps"`` or ``"900GB/s"`` into bits per second (SI prefixes, powers of 1000)."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kKMGT]?)(bps|Bps|b/s|B/s|bit/s)\s*", str(text))
    if not m:
        raise PlanError(f"{where}: expected a rate like 400Gbps or 900GB/s, got {text!r}")
    bits = 8 if m.group(3) in ("Bps", "B/s") else 1
    rate = float(m.group(1)) * _SI[m.group(2)] * bits
    if rate <= 0:
        raise PlanError(f"{where}: expected a rate above zero, got {text!r}")
    return rate


def parse_duration_ns(text: str, where: str = "duration") -> int:
    """Parse ``"2us"``, ``"500ns"``, ``"1.5ms"`` into integer nanoseconds."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*(ns|us|µs|ms|s)\s*", str(text))
    if not m:
        raise PlanError(f"{where}: expected a duration like 2us or 500ns, got {text!r}")
    return int(round(float(m.group(1)) * _TIME[m.group(2)]))


def parse_size(value: Any, where: str = "size") -> int:
    """Parse an integer byte count or ``"25MiB"``/``"512KiB"``/``"1GB"`` into bytes."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*(B|KB|MB|GB|KiB|MiB|GiB)\s*", str(value))
    if not m:
        raise PlanError(f"{where}: expected bytes like 25MiB or 524288, got {value!r}")
    return int(round(float(m.group(1)) * _BIN[m.group(2)]))


GPU_PEAK_TFLOPS = {"A100": 312.0, "H100": 989.0, "H200": 989.0, "B200": 2250.0}
"""Dense BF16 tensor-core peak, TFLOP/s, without sparsity: NVIDIA A100 datasheet (312), H100 SXM
and H200 SXM datasheets (989.4, rounded), HGX B200 datasheet (2.25 PFLOP/s per GPU)."""


@dataclass(frozen=True)
class Training:
    seq_length: int = 2048
    micro_batch_size: int = 1
    global_batch_size: int = 0          # 0: one micro-batch per DP rank (set in load)
    param_dtype: str = "bf16"
    grad_dtype: str = "fp32"
    activation_dtype: str = "bf16"
    mfu: float = 0.4
    dp_bucket_bytes: int = 25 * 1024 * 1024
    dp_first_bucket_bytes: int = 1024 * 1024    # PyTorch DDP _DEFAULT_FIRST_BUCKET_BYTES
    recompute: str = "none"


@dataclass(frozen=True)
class Parallelism:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    order: str = "tp-cp-ep-dp-pp"
    sequence_parallel: bool = False
    zero: int = 0
    zero3_granularity: str = "layer"
    pp_schedule: str = "1f1b"
    virtual_stages: int = 1
    cp_algorithm: str = "ring"
    decoder_first_pipeline_num_layers: int = 0   # 0: even split (Megatron-LM argument names)
    decoder_last_pipeline_num_layers: int = 0

    @property
    def world_size(self) -> int:
        """tp x cp x dp x pp (EP reuses the DP x CP ranks, as in Megatron-LM)."""
        return self.tp * self.cp * self.dp * self.pp


@dataclass(frozen=True)
class Cluster:
    nodes: int
    gpus_per_node: int
    gpu: str = "H100"
    peak_tflops: float = GPU_PEAK_TFLOPS["H100"]
    nics_per_node: int = 0              # 0: one per GPU (set in load)
    nic_rate_bps: float = 400e9
    nvlink_rate_bps: float = 450e9 * 8
    """Per direction, bits/s: half of ``cluster.nvlink_rate``, which is given as NVIDIA quotes it,
    both directions together (H100 SXM: 900 GB/s total = 450 GB/s each way, 18 NVLink 4 links of
    25 GB/s per direction; NVIDIA H100 datasheet and NVLink 4 specifications)."""
    latency_ns: int = 2000
    nvlink_latency_ns: int = 1000
    gpu_nic_map: tuple[int, ...] = ()
    rails: tuple[int, ...] = ()
    subnets: int = 1
    mac_base: str = "02:00:00:00:00:00"
    ipv4_base: str = "10.0.0.0"
    ipv6_prefix: str = "fd00::"

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class Collectives:
    algorithm: Any = "ring"             # a name, or a mapping op -> name
    channels: int = 1
    protocol: str = "simple"
    step_bytes: int = 512 * 1024
    cts: bool = True
    qps_per_connection: int = 1
    split_data_on_qps: bool = False     # NCCL_IB_SPLIT_DATA_ON_QPS (0 by default since NCCL 2.20)
    ring_order: tuple[int, ...] = ()

    def algorithm_for(self, op: str) -> str:
        """Algorithm name for collective ``op`` (a per-op mapping may name some ops only)."""
        if isinstance(self.algorithm, str):
            return self.algorithm
        return self.algorithm.get(op, self.algorithm.get("default", "ring"))


@dataclass(frozen=True)
class Transport:
    kind: str = "rocev2"
    ip_version: int = 4
    path_mtu: int = 4096
    dscp: int = 26
    ecn: str = "ect0"
    vlan: int | None = None
    pcp: int = 0
    verb: str = "write_imm"
    ack: Any = "message"
    initial_psn: str | int = "zero"     # "zero", "random" or a fixed 24-bit PSN
    ecn_marking: Mapping[str, Any] | None = None
    grh: bool = False

    @property
    def ecn_bits(self) -> int:
        """ECN codepoint for data packets (RFC 3168): not-ect 0, ect1 1, ect0 2."""
        return {"not-ect": 0, "ect1": 1, "ect0": 2}[self.ecn]


@dataclass(frozen=True)
class Plan:
    """A validated plan. ``model`` is None for cluster-only plans used with a measured schedule."""

    name: str
    model: ModelConfig | None
    training: Training
    parallelism: Parallelism
    cluster: Cluster
    collectives: Collectives
    transport: Transport
    seed: int = 0
    source: str = ""
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per iteration per DP replica: global / (micro x dp)."""
        t, p = self.training, self.parallelism
        return t.global_batch_size // (t.micro_batch_size * p.dp)


@functools.lru_cache(maxsize=1)
def _validator() -> jsonschema.protocols.Validator:
    schema = json.loads((schema_dir() / "plan.schema.json").read_text())
    cls = jsonschema.validators.validator_for(schema)
    return cls(schema)


def _json_path(err: jsonschema.ValidationError) -> str:
    out = "$"
    for p in err.absolute_path:
        out += f"[{p}]" if isinstance(p, int) else f".{p}"
    return out


def validate_document(doc: Any, require_model: bool = True) -> None:
    """Validate a parsed plan against the JSON Schema; raise PlanError for the first problem.

    With ``require_model=False`` a plan without ``model`` (and ``parallelism``) is accepted: it
    describes only the cluster, collectives and transport for a measured schedule.
    """
    _require_object(doc)
    if not require_model:
        doc = dict(doc)
        doc.setdefault("model", {"preset": "gpt2-small"})
        doc.setdefault("parallelism", {})
    errors = sorted(_validator().iter_errors(doc), key=lambda e: (len(list(e.absolute_path)), e.path))
    if errors:
        e = max(errors[:1] + [x for x in errors if x.validator in ("required", "additionalProperties")][:1],
                key=lambda x: len(list(x.absolute_path)))
        e = errors[0] if errors[0].validator != "oneOf" else e
        if e.validator == "oneOf":
            raise PlanError(_one_of_message(e))
        raise PlanError(f"plan {_json_path(e)}: {e.message}")


def _one_of_message(e: jsonschema.ValidationError) -> str:
    """A value that fits none of the alternatives: the problem within the alternative of the
    value's own type (the one that got furthest), and what the field expects."""
    best = jsonschema.exceptions.best_match(e.context, key=_branch_relevance) if e.context else e
    expect = (best.schema.get("description") if isinstance(best.schema, dict) else None) \
        or e.schema.get("description", "")
    msg = f"plan {_json_path(best)}: {best.message}"
    return f"{msg} (expected: {expect})" if expect else msg


def _branch_relevance(err: jsonschema.ValidationError):
    # an alternative of another type (enum/type failing at the value itself) is the weakest match
    wrong_kind = err.validator in ("type", "enum") and len(err.relative_path) == 0
    return (not wrong_kind, len(err.absolute_path))


_FLOAT_FIELDS = {"mfu", "capacity_factor", "fraction", "peak_tflops"}


def _integral_floats_to_int(value: Any, key: str = "") -> Any:
    """JSON Schema counts ``4.0`` as an integer; turn such numbers into ints (except the fields
    that are real numbers) so that ``"tp": 4.0`` means ``"tp": 4``."""
    if isinstance(value, dict):
        return {k: _integral_floats_to_int(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [_integral_floats_to_int(v, key) for v in value]
    if isinstance(value, float) and value.is_integer() and key not in _FLOAT_FIELDS:
        return int(value)
    return value


def _require_object(doc: Any) -> None:
    """A plan is a JSON object; name what was given instead (PlanError)."""
    if not isinstance(doc, Mapping):
        kind = {list: "an array", str: "a string", bool: "true/false", type(None): "null"}.get(type(doc), "a number")
        raise PlanError(f"plan: expected a JSON object ({{\"model\": ..., \"cluster\": ...}}), not {kind}")


MIN_STEP_BYTES = 256
"""Smallest ``collectives.step_bytes`` accepted: the smallest path MTU (runs that would lower to
more messages than fit in memory are refused before lowering, see ``pipeline.shards``)."""


def from_dict(doc: Mapping[str, Any], base_dir: Path | None = None, source: str = "",
              require_model: bool = True) -> Plan:
    """Build a :class:`Plan` from a parsed JSON document (see :func:`load`)."""
    _require_object(doc)
    doc = _integral_floats_to_int(dict(doc))
    validate_document(doc, require_model=require_model)
    tr = dict(doc.get("training", {}))
    pa_ = dict(doc.get("parallelism", {}))
    cl = dict(doc["cluster"])
    co = dict(doc.get("collectives", {}))
    tp = dict(doc.get("transport", {}))

    model = resolve_model(doc["model"], base_dir) if "model" in doc else None
    par = Parallelism(**pa_)
    gpu = cl.pop("gpu", "H100")
    peak = gpu["peak_tflops"] if isinstance(gpu, dict) else GPU_PEAK_TFLOPS[gpu]
    cluster = Cluster(
        nodes=cl["nodes"], gpus_per_node=cl["gpus_per_node"],
        gpu=gpu if isinstance(gpu, str) else "custom", peak_tflops=float(peak),
        nics_per_node=cl.get("nics_per_node", cl["gpus_per_node"]),
        nic_rate_bps=parse_rate(cl.get("nic_rate", "400Gbps"), "plan $.cluster.nic_rate"),
        nvlink_rate_bps=parse_rate(cl.get("nvlink_rate", "900GB/s"), "plan $.cluster.nvlink_rate") / 2,
        latency_ns=parse_duration_ns(cl.get("latency", "2us"), "plan $.cluster.latency"),
        nvlink_latency_ns=parse_duration_ns(cl.get("nvlink_latency", "1us"), "plan $.cluster.nvlink_latency"),
        gpu_nic_map=tuple(cl.get("gpu_nic_map", ())), rails=tuple(cl.get("rails", ())),
        subnets=cl.get("subnets", 1),
        **{k: cl[k] for k in ("mac_base", "ipv4_base", "ipv6_prefix") if k in cl},
    )
    if "dp_bucket_bytes" in tr:
        tr["dp_bucket_bytes"] = parse_size(tr["dp_bucket_bytes"], "plan $.training.dp_bucket_bytes")
    if "dp_first_bucket_bytes" in tr:
        tr["dp_first_bucket_bytes"] = parse_size(tr["dp_first_bucket_bytes"], "plan $.training.dp_first_bucket_bytes")
    tr.setdefault("activation_dtype", tr.get("param_dtype", "bf16"))
    if "global_batch_size" not in tr:
        tr["global_batch_size"] = tr.get("micro_batch_size", 1) * par.dp
    training = Training(**tr)
    if "step_bytes" in co:
        co["step_bytes"] = parse_size(co["step_bytes"], "plan $.collectives.step_bytes")
        if co["step_bytes"] < MIN_STEP_BYTES:
            raise PlanError(f"plan $.collectives.step_bytes: {co['step_bytes']:,} B is below the "
                            f"minimum {MIN_STEP_BYTES:,} B (NCCL's steps are NCCL_BUFFSIZE / 8, 512 KiB by default; "
                            "the smallest path MTU is 256 B)")
    if "ring_order" in co:
        co["ring_order"] = tuple(co["ring_order"])
    collectives = Collectives(**co)
    transport = Transport(**tp)
    plan = Plan(name=doc.get("name", source or "plan"), model=model, training=training,
                parallelism=par, cluster=cluster, collectives=collectives, transport=transport,
                seed=doc.get("seed", 0), source=source, raw=doc)
    check_consistency(plan, require_model=require_model and "model" in doc)
    return plan


def _check_transport(tr: Transport) -> None:
    """Transport settings that contradict each other (rather than being silently ignored)."""
    if tr.kind == "ib":
        for name, bad in (("ip_version", tr.ip_version == 6), ("vlan", tr.vlan is not None),
                          ("pcp", tr.pcp != 0)):
            if bad:
                raise PlanError(f"plan $.transport.{name}: native InfiniBand frames have no "
                                f"{'IP header' if name == 'ip_version' else '802.1Q tag'}; "
                                f"remove {name} or use kind \"rocev2\"")
    elif tr.grh:
        raise PlanError("plan $.transport.grh: a GRH belongs to native InfiniBand (kind \"ib\"); RoCEv2 "
                        "frames carry an IP header instead")
    if tr.kind == "ib" and (tr.dscp != 26 or tr.ecn != "ect0"):
        name = "dscp" if tr.dscp != 26 else "ecn"
        raise PlanError(f"plan $.transport.{name}: native InfiniBand frames have no IP header to carry "
                        f"DSCP and ECN (their GRH traffic class is 0); remove {name} or use kind \"rocev2\"")
    if tr.kind == "ib" and tr.ecn_marking:
        raise PlanError("plan $.transport.ecn_marking: CE marks and CNPs are modelled for RoCEv2 (IP ECN "
                        "bits); remove ecn_marking or use kind \"rocev2\"")
    if isinstance(tr.ack, Mapping) and "every_packets" in tr.ack and "window" in tr.ack:
        raise PlanError("plan $.transport.ack: give either every_packets or window, not both")
    if isinstance(tr.ack, Mapping) and "window" in tr.ack \
            and parse_duration_ns(tr.ack["window"], "plan $.transport.ack.window") <= 0:
        raise PlanError("plan $.transport.ack.window: must be above 0 (a window of 0 would acknowledge "
                        "each message, as ack \"message\" does)")
    if tr.ecn_marking is not None and not tr.ecn_marking.get("fraction", 1) \
            and "queue_bytes" not in tr.ecn_marking:
        raise PlanError("plan $.transport.ecn_marking.fraction: 0 marks nothing; give a fraction above 0 "
                        "or queue_bytes, or remove ecn_marking")
    if tr.ecn_marking is not None and not {"fraction", "queue_bytes"} & set(tr.ecn_marking):
        raise PlanError("plan $.transport.ecn_marking: give fraction (a seeded share of data packets "
                        "marked CE) or queue_bytes (mark when the NIC queue holds more), or both; "
                        "without either nothing is marked")


def check_consistency(plan: Plan, require_model: bool = True) -> None:
    """Raise PlanError when numbers of the plan disagree, naming both sides."""
    _check_transport(plan.transport)
    p, c, t, m = plan.parallelism, plan.cluster, plan.training, plan.model
    if c.gpu_nic_map and len(c.gpu_nic_map) != c.gpus_per_node:
        raise PlanError(f"plan $.cluster.gpu_nic_map has {len(c.gpu_nic_map)} entries but gpus_per_node = {c.gpus_per_node}")
    if c.gpu_nic_map and max(c.gpu_nic_map) >= c.nics_per_node:
        raise PlanError(f"plan $.cluster.gpu_nic_map names NIC {max(c.gpu_nic_map)} but nics_per_node = {c.nics_per_node}")
    if c.rails and len(c.rails) != c.nics_per_node:
        raise PlanError(f"plan $.cluster.rails has {len(c.rails)} entries but nics_per_node = {c.nics_per_node}")
    if not require_model:
        return
    if p.world_size != c.world_size:
        raise PlanError(f"plan: tp*cp*dp*pp = {p.tp}*{p.cp}*{p.dp}*{p.pp} = {p.world_size} "
                        f"but nodes*gpus_per_node = {c.nodes}*{c.gpus_per_node} = {c.world_size}")
    if (p.dp * p.cp) % p.ep:
        raise PlanError(f"plan: ep = {p.ep} does not divide dp*cp = {p.dp * p.cp}")
    if m is None:
        return
    if m.num_attention_heads % p.tp:
        raise PlanError(f"plan: num_attention_heads = {m.num_attention_heads} is not divisible by tp = {p.tp}")
    if m.num_key_value_heads % p.tp:
        raise PlanError(f"plan: num_key_value_heads = {m.num_key_value_heads} is not divisible by tp = {p.tp} "
                        "(Megatron-LM requires num_query_groups % tensor_model_parallel_size == 0)")
    if p.ep > 1 and not m.is_moe:
        raise PlanError(f"plan: ep = {p.ep} but the model has no experts (num_local_experts = {m.num_local_experts})")
    if p.decoder_first_pipeline_num_layers or p.decoder_last_pipeline_num_layers:
        from .models import stage_layers
        stage_layers(m.num_hidden_layers, p.pp, p.virtual_stages,
                     p.decoder_first_pipeline_num_layers, p.decoder_last_pipeline_num_layers)
    elif m.num_hidden_layers % (p.pp * p.virtual_stages):
        raise PlanError(f"plan: num_hidden_layers = {m.num_hidden_layers} is not divisible by "
                        f"pp*virtual_stages = {p.pp}*{p.virtual_stages}")
    if m.is_moe and m.num_local_experts % p.ep:
        raise PlanError(f"plan: num_local_experts = {m.num_local_experts} is not divisible by ep = {p.ep}")
    if t.global_batch_size % (t.micro_batch_size * p.dp):
        raise PlanError(f"plan: global_batch_size = {t.global_batch_size} is not divisible by "
                        f"micro_batch_size*dp = {t.micro_batch_size}*{p.dp} = {t.micro_batch_size * p.dp}")
    if t.seq_length % (2 * p.cp if p.cp > 1 else 1):
        raise PlanError(f"plan: seq_length = {t.seq_length} is not divisible by 2*cp = {2 * p.cp}")
    if p.sequence_parallel and t.seq_length % (p.tp * p.cp):
        raise PlanError(f"plan: seq_length = {t.seq_length} is not divisible by tp*cp = {p.tp * p.cp} (sequence parallel)")
    if p.pp_schedule == "interleaved" and p.pp < 2:
        raise PlanError(f"plan $.parallelism.pp_schedule: interleaved needs pipeline parallelism (pp > 1); "
                        f"with pp = {p.pp} there is one stage")
    if p.pp_schedule == "interleaved" and p.virtual_stages < 2:
        raise PlanError("plan: pp_schedule interleaved needs virtual_stages >= 2")
    if p.virtual_stages > 1 and p.pp_schedule != "interleaved":
        # Megatron-LM runs the interleaved 1F1B schedule whenever a virtual pipeline size is set
        raise PlanError(f"plan $.parallelism.virtual_stages: {p.virtual_stages} needs pp_schedule interleaved "
                        f"({p.pp_schedule} runs one model chunk per pipeline rank)")
    if (m.position_embedding == "learned" and m.max_position_embeddings
            and t.seq_length > m.max_position_embeddings):
        raise PlanError(f"plan: seq_length = {t.seq_length} exceeds the model's learned position table "
                        f"(max_position_embeddings = {m.max_position_embeddings})")
    if p.pp_schedule == "interleaved" and plan.num_microbatches % p.pp:
        raise PlanError(f"plan: interleaved schedule needs micro-batches ({plan.num_microbatches}) divisible by pp = {p.pp}")


def load(path: str | Path, require_model: bool = True) -> Plan:
    """Load and validate a plan file.

    Parameters
    ----------
    path : JSON file.
    require_model : False for a cluster-only plan (``generate --schedule``): model, training and
        parallelism may be absent.

    Raises
    ------
    PlanError : unreadable file, a file that is not UTF-8 text (a capture given as the plan),
        invalid JSON (with line and column), a schema violation (with the
        JSON path), or inconsistent numbers.
    """
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as e:
        raise PlanError(f"cannot read plan {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise PlanError(f"plan {path}: not a JSON text file (byte {e.start} is not UTF-8)") from None
    def unique_keys(pairs: list) -> dict:
        seen: dict = {}
        for k, v in pairs:
            if k in seen:
                raise PlanError(f"plan {path}: key {k!r} appears twice in one object (JSON would keep "
                                f"only the last); remove one")
            seen[k] = v
        return seen

    def no_constant(name: str):
        raise PlanError(f"plan {path}: {name} is not a JSON number (give a number)")

    try:
        doc = json.loads(text, object_pairs_hook=unique_keys, parse_constant=no_constant)
    except json.JSONDecodeError as e:
        raise PlanError(f"plan {path}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    return from_dict(doc, base_dir=path.parent, source=str(path), require_model=require_model)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


__all__ = ["Plan", "Training", "Parallelism", "Cluster", "Collectives", "Transport", "load",
           "from_dict", "parse_rate", "parse_duration_ns", "parse_size", "DTYPE_BYTES",
           "GPU_PEAK_TFLOPS"]
