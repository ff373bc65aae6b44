"""Latency-aware search: step timing (measured or estimated) on hardware profiles."""

from tf_hwopt.search.timing import StepTiming, estimate_step, model_memory_bytes, time_step
