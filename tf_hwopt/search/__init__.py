"""Latency-aware search: hardware-aligned spaces and step timing (measured or estimated)."""

from tf_hwopt.search.spaces import HardwareSpace, aligned_range, load_space, power_of_two_multiples
from tf_hwopt.search.timing import StepTiming, estimate_step, model_memory_bytes, time_step
from tf_hwopt.search.oracle import LatencyAwareOracle, mnasnet_reward
from tf_hwopt.search.tuner import LatencyAwareTuner, is_search_worker
