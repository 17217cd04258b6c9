"""Prefix-cache statistics, collected per ``make_prefix_cache_stats`` interval."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PrefixCacheStats:
    """Lookups since the last ``make_prefix_cache_stats()``.

    ``queries``/``hits`` count tokens; a request that was preempted before is counted in the
    ``preempted_*`` fields instead (its re-admission mostly hits its own blocks, which would
    inflate the hit rate).  ``reset`` is set when the prefix cache was reset in the interval.
    """

    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0
    reset: bool = False

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits

    @property
    def hit_rate(self) -> float:
        """Token hit rate of first-time lookups (0.0 when there were none)."""
        return self.hits / self.queries if self.queries else 0.0
