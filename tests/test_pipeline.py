"""Pipeline helpers: bus factors from the lowering, and the busbw check of nccl-tests output."""

from __future__ import annotations

import pytest

from wiretrace.pipeline import lowered_bus_factor

from conftest import REAL, run_cli


@pytest.mark.parametrize("n", [2, 3, 8, 32])
@pytest.mark.parametrize("op,factor", [
    ("all_reduce", lambda n: 2 * (n - 1) / n), ("all_gather", lambda n: (n - 1) / n),
    ("reduce_scatter", lambda n: (n - 1) / n), ("all_to_all", lambda n: (n - 1) / n),
    ("broadcast", lambda n: 1.0), ("reduce", lambda n: 1.0),
])
def test_lowered_bus_factor_is_the_nccl_tests_factor(op, factor, n):
    """nccl-tests doc/PERFORMANCE.md: busbw = algbw x factor(op, n); sizes divisible by n."""
    size = 4 * n * 12_345
    assert lowered_bus_factor(op, n, size) == pytest.approx(factor(n), abs=1e-12)


def test_schedule_from_nccl_tests_prints_the_busbw_check(tmp_path):
    proc = run_cli("schedule", "--from", REAL / "nccl_tests" / "rccl1490_allgather_32ranks_srun_label.txt",
                   "-o", tmp_path / "s")
    assert proc.returncode == 0, proc.stderr
    check = proc.stdout[proc.stdout.index("busbw check"):]
    lines = [line.split() for line in check.splitlines() if line.strip().startswith("all_gather ")]
    assert len(lines) == 5
    for op, n, size, time_us, busbw, factor, predicted, diff in lines:
        assert (op, n, factor) == ("all_gather", "32", f"{31 / 32:.4f}")
        # size / time x 31/32 gives the logged busbw up to its two printed decimals
        assert abs(float(diff)) <= 0.01
        assert float(predicted) == pytest.approx(int(size.replace(",", "")) / (float(time_us) * 1e3) * 31 / 32,
                                                 abs=0.006)
