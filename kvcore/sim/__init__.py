"""Prefix-cache science: trace loaders, synthetic workloads, replay through the real scheduler
and manager, an eviction-policy simulator with the offline optimum, and plots."""
