"""Data files for `dvc plots`: small CSVs the stages write beside their metrics, shown per dataset by
`dvc plots show` and compared across experiments by `dvc plots diff`.

- `plots/completion_lengths.csv` (generate): the selected responses' completion lengths in HISTOGRAM_BINS bins of
  equal width up to max_tokens (the same bins in every run of a dataset, so experiments line up);
- `plots/budget_fill.csv` (generate): tokens counted toward the budget against seconds since generation began
  (every finished response counts, so the line may end a little past the output's total when responses finishing
  together crossed the budget: the output keeps the plan-order prefix that meets it, the rest stay in the store),
  and the budget on every row (the chart's dashed line); a run that only reused the store is one point at 0 s;
- `plots/skips.csv` (tokenize): the responses kept (a sample holds them), then those skipped by reason (every
  reason, zeros included, so runs line up; the kept bar keeps a run that skipped nothing from an empty chart).

Their vega-lite templates are in conf/plots/; the page they are drawn on, conf/plots/page.html, carries its own
copy of vega (scripts/vendor_plots.py), so it draws offline.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

HISTOGRAM_BINS = 16


def histogram(lengths: Iterable[int], max_tokens: int, bins: int = HISTOGRAM_BINS) -> list[dict]:
    """Rows {length: "lo-hi", responses: n}; the last bin holds max_tokens itself (a response cut at the limit)."""
    width = max(1, math.ceil(max_tokens / bins))
    counts = [0] * bins
    for n in lengths:
        counts[min(bins - 1, n // width)] += 1
    digits = len(str(max_tokens))  # zero-padded: the labels sort as the bins do
    return [
        {"length": f"{i * width:0{digits}d}-{min(max_tokens, (i + 1) * width - 1):0{digits}d}", "responses": c}
        for i, c in enumerate(counts)
    ]


def fill_rows(fill: list[tuple[float, int]], budget: int) -> list[dict]:
    """budget_fill.csv's rows: each point of the fill, and the budget it fills toward."""
    return [{"seconds": t, "tokens": n, "budget": budget} for t, n in fill]


def outcome_rows(responses: int, skipped: dict[str, int], reasons: Iterable[str]) -> list[dict]:
    """skips.csv's rows: the responses kept, then the skipped ones by reason (every one of `reasons`, zeros too)."""
    rows = [{"reason": "kept", "responses": responses - sum(skipped.values())}]
    return rows + [{"reason": r, "responses": skipped.get(r, 0)} for r in sorted(set(reasons) | set(skipped))]
