"""Markdown tables for the benchmark scripts (no jax import, so a script that must choose its own platform, such
as ``gpu_suite.py``, can use it)."""

from __future__ import annotations


def table(rows: list[dict], columns: list[tuple[str, str]], *, decimals: int = 2, whole_above: float = 1e4) -> str:
    """Markdown table; ``columns`` are (key, header). Floats get ``decimals`` digits below ``whole_above`` and none
    above it; a missing value or None prints as ``-``."""
    def fmt(v):
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:,.{decimals}f}" if abs(v) < whole_above else f"{v:,.0f}"
        return f"{v:,}" if isinstance(v, int) else str(v)

    lines = ["| " + " | ".join(h for _, h in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(k)) for k, _ in columns) + " |" for r in rows]
    return "\n".join(lines)
