"""Plain-text tables with a kvcore column, a peer column and their ratio."""

from __future__ import annotations

from collections.abc import Sequence


def ratio(ours: float | None, peer: float | None) -> str:
    if ours is None or peer is None or peer == 0:
        return "n/a"
    return f"{ours / peer:.2f}x"


def fmt(value: float | None, digits: int = 1) -> str:
    if value is None:
        return "n/a"
    if abs(value) >= 1e6:
        return f"{value:,.0f}"
    return f"{value:,.{digits}f}"


def render(headers: Sequence[str], rows: Sequence[Sequence[str]], title: str = "") -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(headers)]
    lines = [title] if title else []
    lines.append("  ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(headers, widths))))
    lines.append("  ".join("-" * w for w in widths))
    for r in rows:
        lines.append("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
    return "\n".join(lines)
