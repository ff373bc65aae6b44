"""Latency-aware search: hardware-aligned spaces, step timing, latency-aware oracles and tuners."""

from tf_hwopt.search.spaces import HardwareSpace, aligned_range, load_space, power_of_two_multiples
from tf_hwopt.search.timing import StepTiming, estimate_step, median_of_block_medians, model_memory_bytes, time_step
from tf_hwopt.search.inputs import check_timeable, timing_batch
from tf_hwopt.search.dominance import confirmed_directions, dominated
from tf_hwopt.search.pareto import pareto_front
from tf_hwopt.search.oracle import (
    LatencyAwareBayesianOptimizationOracle,
    LatencyAwareHyperbandOracle,
    LatencyAwareOracle,
    LatencyAwareRandomSearchOracle,
    mnasnet_reward,
)
from tf_hwopt.search.tuner import (
    LatencyAwareBayesianOptimization,
    LatencyAwareHyperband,
    LatencyAwareRandomSearch,
    LatencyAwareTuner,
    is_search_worker,
)
