"""The samples' headline numbers, worked out by hand in the README, reproduced by the pipeline.

Hand derivations (README "The samples, worked out by hand"): Megatron-LM vocabulary padding to a
multiple of 128*tp and its column/row-parallel split; PyTorch DDP bucketing (reverse registration
order, first bucket 1 MiB, then 25 MiB); ring all-reduce volume 2(n-1)/n*S per rank; PP sends of
b*s*h activations per micro-batch per boundary.
"""

from __future__ import annotations

import numpy as np
import pyarrow.compute as pc

from wiretrace import collectives, pipeline, plan as P, topology, workload

from conftest import SAMPLES


def network_bytes_per_rank(path, parallelisms):
    p = P.load(path)
    t = topology.build(p)
    c = pipeline.select_collectives(workload.build_collectives(p),
                                    pipeline.Selection(parallelism=frozenset(parallelisms)))
    c = collectives.resolve_algorithms(c, t, p)
    m = collectives.lower(c, t, p)
    net = m["link"] == "network"
    data = net & (m["kind"] == "data")
    cts = net & (m["kind"] == "cts")
    per = np.bincount(m["src_rank"][data], weights=m["bytes"][data], minlength=t.world_size)
    return c, m, per.astype(np.int64), np.bincount(m["src_rank"][cts], minlength=t.world_size)


def dp_buckets(coll, rank):
    rows = coll.filter(pc.equal(coll.column("parallelism"), "dp")).to_pylist()
    return [r for r in rows if rank in r["ranks"]]


def test_demo_numbers():
    c, m, per, cts = network_bytes_per_rank(SAMPLES / "gpt2-small-2x4.json", {"dp", "tp"})
    per_gpu_params = 12_672 * 768 + 1024 * 768 + 12 * 1_775_424 + 1536
    assert per_gpu_params == 31_825_152
    for rank in range(8):
        b = dp_buckets(c, rank)
        assert len(b) == 5
        assert sum(r["bytes_global"] for r in b) == 4 * per_gpu_params
    assert per.tolist() == [127_300_608] * 8
    assert cts.tolist() == [250] * 8
    tp = set(c.filter(pc.equal(c.column("parallelism"), "tp")).column("op_id").to_pylist())
    assert set(m["link"][np.isin(m["op_id"], list(tp))]) == {"nvlink"}


def test_llama3_8b_numbers():
    c, m, per, _ = network_bytes_per_rank(SAMPLES / "llama3-8b-4x8.json", {"dp", "pp"})
    layer = 2_097_152 + 2 * 524_288 + 2_097_152 + 3 * 7_340_032 + 8_192
    assert layer == 27_271_168
    stage0 = 16 * layer + 129_024 // 8 * 4096
    stage1 = 16 * layer + 129_024 // 8 * 4096 + 4096
    assert (stage0, stage1) == (502_398_976, 502_403_072)
    assert len(dp_buckets(c, 0)) == 49 and len(dp_buckets(c, 16)) == 50
    pp = 32 * 1 * 8192 * 4096 * 2
    assert pp == 2_147_483_648
    assert set(per[:16].tolist()) == {4 * stage0 + pp} == {4_157_079_552}
    assert set(per[16:].tolist()) == {4 * stage1 + pp} == {4_157_095_936}
