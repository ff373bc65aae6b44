"""Benchmarks that print measured ratios side by side in one run."""

from tf_hwopt.bench.freezing import STRATEGIES, run_freezing_benchmark
from tf_hwopt.bench.throughput import analytic_floor_fraction, freezing_throughput
from tf_hwopt.bench.workloads import WORKLOADS, Workload

__all__ = [
    "STRATEGIES",
    "WORKLOADS",
    "Workload",
    "analytic_floor_fraction",
    "freezing_throughput",
    "run_freezing_benchmark",
]
