"""Text for ``kvcore replay --replicas N --router ...``: the dynamo router's lines and the
table that puts several routers' runs of one trace side by side."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvcore.sim.cluster import ClusterResult


def dynamo_lines(report: Mapping[str, Any]) -> list[str]:
    """What the dynamo router cost and where Dynamo's answers differed from kvcore's index."""
    d = report["disagreements"]
    causes = ", ".join(f"{n:,} {cause}" for cause, n in sorted(d["by_cause"].items()))
    return [
        f"  Dynamo indexer:  started in {report['start_s']:.2f} s; {report['queries']:,} "
        f"queries, {report['barriers']:,} barriers ({report['barrier_polls']:,} polls, "
        f"{report['barrier_s']:.1f} s waiting for events to be applied)",
        f"  vs kvcore index: {d['agreed']:,} of {d['queries']:,} lookups agreed on every "
        f"replica; kvcore matched more on {d['kvcore_more']:,} (request, replica) pairs, "
        f"Dynamo on {d['dynamo_more']:,}" + (f" (causes: {causes})" if causes else ""),
        f"                   kvcore's index would have routed {d['decisions_changed']:,} "
        f"requests elsewhere; {d['unpredicted']:,} answers not predicted by Dynamo's rules",
    ]


def router_table(results: Sequence[ClusterResult]) -> list[str]:
    """One row per router: hit rate, simulated TTFT, imbalance, requests per replica (its
    decisions), wall time of the run, and the dynamo router's disagreements with kvcore's
    index."""
    width = max(len(r.router) for r in results)
    lines = [f"  {'router':{width}}  hit rate  TTFT p50   p99 (ms)  imbalance  "
             "requests per replica      wall (s)  disagreements"]
    for r in results:
        per_replica = "/".join(f"{x.requests:,}" for x in r.replicas)
        if r.dynamo is None:
            disagree = "-"
        else:
            d = r.dynamo["disagreements"]
            disagree = f"{d['queries'] - d['agreed']:,} of {d['queries']:,} lookups"
        lines.append(f"  {r.router:{width}}  {r.token_hit_rate:7.2%}  {r.ttft_ms_median:8,.0f}  "
                     f"{r.ttft_ms_p99:8,.0f}  {r.imbalance:9.2f}  {per_replica:24}  {r.wall_s:8.1f}  "
                     f"{disagree}")
    return lines
