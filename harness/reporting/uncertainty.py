"""Sampling uncertainty of scores: seeded 95 % bootstrap intervals, paired over the samples two systems share.

- A score (one system, one task unit) is the mean of its per-sample scores; its interval resamples samples.
- A retention is policy ÷ reference on the same samples, chance-corrected where the task has a chance score:
  (mean policy − mean chance) ÷ (mean reference − mean chance). Its interval resamples samples jointly for the
  policy, the reference and the chance scores (a paired bootstrap), so the shared difficulty of a sample cancels.
- A difference between two systems is the mean of per-sample differences, paired the same way.
- Aggregates over several task units (the macro mean of per-unit retentions, FlexiCache's average) resample
  samples within each unit (a stratified bootstrap), so every unit keeps its own n.
- A ratio of two independent samples' means (two servers' request latencies) resamples each sample on its own.
- A difference between two measurements repeated in a few blocks (rounds run back to back) is the mean of the
  blocks' differences with a Student t interval: too few blocks for a bootstrap.

Means and paired differences come from `scipy.stats.bootstrap` (percentile method). Ratios (retention) and
aggregates over units use the same percentile bootstrap done unit by unit (a stratified bootstrap, which scipy does
not offer); resamples where a ratio is undefined (the reference equals chance in every drawn sample) are left out.
Every call draws from its own generator seeded with SEED: rerunning a summary gives the same intervals, and two
systems compared on the same samples are resampled with the same draws.
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats

from harness.reporting.tables import finite

N_RESAMPLES = 10_000
CONFIDENCE = 0.95
SEED = 0


@dataclass(frozen=True)
class Estimate:
    """A point estimate with its bootstrap interval and the number of samples behind it."""

    value: float
    low: float
    high: float
    n: int

    def fmt(self, digits: int = 2, with_n: bool = True) -> str:
        """`0.82 [0.71, 0.93] n=120` (— for an undefined value)."""
        if not finite(self.value):
            return "—"
        ci = (f" [{self.low:.{digits}f}, {self.high:.{digits}f}]" if finite(self.low) and finite(self.high)
              else " [—]")
        return f"{self.value:.{digits}f}{ci}" + (f" n={self.n}" if with_n else "")

    def excludes(self, x: float = 0.0) -> bool:
        """Whether the interval lies wholly on one side of x (an ordering the data support)."""
        return finite(self.low) and finite(self.high) and (self.low > x or self.high < x)

    def as_dict(self, prefix: str = "") -> dict[str, float | int]:
        return {f"{prefix}value" if prefix else "value": self.value, f"{prefix}ci_low": self.low,
                f"{prefix}ci_high": self.high, f"{prefix}n": self.n}


NAN = Estimate(math.nan, math.nan, math.nan, 0)


def _array(x: Sequence[float] | np.ndarray) -> np.ndarray:
    return np.asarray(list(x), dtype=np.float64)


def _scipy_interval(data: tuple[np.ndarray, ...], statistic: Callable, paired: bool) -> tuple[float, float]:
    if len(data[0]) < 2:
        return math.nan, math.nan
    if all(np.all(a == a[0]) for a in data):     # every resample is the sample itself
        value = float(statistic(*data, axis=-1))
        return value, value
    with np.errstate(divide="ignore", invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", stats.DegenerateDataWarning)
        res = stats.bootstrap(data, statistic, paired=paired, vectorized=True, n_resamples=N_RESAMPLES,
                              confidence_level=CONFIDENCE, method="percentile",
                              random_state=np.random.default_rng(SEED))
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def mean(values: Sequence[float]) -> Estimate:
    """The mean of per-sample scores with its bootstrap interval."""
    x = _array(values)
    if x.size == 0:
        return NAN
    low, high = _scipy_interval((x,), lambda a, axis: np.mean(a, axis=axis), paired=False)
    return Estimate(float(x.mean()), low, high, int(x.size))


def _retention(p: np.ndarray, r: np.ndarray, c: np.ndarray, axis: int = -1) -> np.ndarray:
    base = np.mean(c, axis=axis)
    with np.errstate(divide="ignore", invalid="ignore"):
        return (np.mean(p, axis=axis) - base) / (np.mean(r, axis=axis) - base)


def retention(policy: Sequence[float], reference: Sequence[float], chance: Sequence[float] | None = None
              ) -> Estimate:
    """(mean policy − mean chance) ÷ (mean reference − mean chance) over paired samples (chance 0 when None)."""
    p, r = _array(policy), _array(reference)
    if p.size != r.size:
        raise ValueError(f"retention needs paired samples: {p.size} policy vs {r.size} reference scores")
    c = np.zeros_like(p) if chance is None else _array(chance)
    if p.size == 0:
        return NAN
    value, low, high = stratified([(p, r, c)], lambda us: _retention(us[0][0], us[0][1], us[0][2]))
    if not math.isfinite(value):
        return Estimate(math.nan, math.nan, math.nan, int(p.size))
    return Estimate(value, low, high, int(p.size))


def difference(a: Sequence[float], b: Sequence[float]) -> Estimate:
    """mean(a − b) over paired samples, with its paired interval."""
    x, y = _array(a), _array(b)
    if x.size != y.size:
        raise ValueError(f"difference needs paired samples: {x.size} vs {y.size}")
    if x.size == 0:
        return NAN
    low, high = _scipy_interval((x - y,), lambda d, axis: np.mean(d, axis=axis), paired=False)
    return Estimate(float(np.mean(x - y)), low, high, int(x.size))


def unpaired_difference(a: Sequence[float], b: Sequence[float]) -> Estimate:
    """mean(a) − mean(b) over two independent samples (e.g. two load clients' requests), each resampled on its
    own; n is the smaller sample."""
    x, y = _array(a), _array(b)
    if x.size == 0 or y.size == 0:
        return NAN
    low, high = (_scipy_interval((x, y), lambda p, q, axis: np.mean(p, axis=axis) - np.mean(q, axis=axis),
                                 paired=False) if min(x.size, y.size) >= 2 else (math.nan, math.nan))
    return Estimate(float(x.mean() - y.mean()), low, high, int(min(x.size, y.size)))


def unpaired_ratio(a: Sequence[float], b: Sequence[float]) -> Estimate:
    """mean(a) ÷ mean(b) over two independent samples (e.g. two servers' request latencies), each resampled on its
    own; n is the smaller sample."""
    x, y = _array(a), _array(b)
    if x.size == 0 or y.size == 0 or not y.mean() > 0:
        return NAN
    low, high = (_scipy_interval((x, y), lambda p, q, axis: np.mean(p, axis=axis) / np.mean(q, axis=axis),
                                 paired=False) if min(x.size, y.size) >= 2 else (math.nan, math.nan))
    return Estimate(float(x.mean() / y.mean()), low, high, int(min(x.size, y.size)))


def blocked_difference(a: Sequence[float], b: Sequence[float]) -> Estimate:
    """mean(a − b) over blocks: a[k] and b[k] are one figure each of two measurements taken back to back in block
    k (e.g. two load clients' mean TPOT in one round), so a drift of a shared machine between blocks cancels in
    their difference and what is left varies as the whole measurement does from one run to the next. The interval
    is Student's t over the blocks' differences (k − 1 degrees of freedom): with the handful of blocks such runs
    afford, a bootstrap has too few distinct resamples to give one. n is the number of blocks."""
    x, y = _array(a), _array(b)
    if x.size != y.size:
        raise ValueError(f"blocked_difference needs one pair per block: {x.size} vs {y.size}")
    d = x - y
    if d.size == 0:
        return NAN
    value = float(d.mean())
    if d.size < 2:
        return Estimate(value, math.nan, math.nan, int(d.size))
    half = float(stats.t.ppf((1 + CONFIDENCE) / 2, d.size - 1) * d.std(ddof=1) / math.sqrt(d.size))
    return Estimate(value, value - half, value + half, int(d.size))


def stratified(units: Sequence[tuple[Sequence[float] | np.ndarray, ...]],
               statistic: Callable[[list[tuple[np.ndarray, ...]]], np.ndarray]) -> tuple[float, float, float]:
    """Point and percentile interval of `statistic` over several units of paired samples.

    units: per unit, a tuple of equally long per-sample arrays (e.g. policy, reference, chance scores).
    statistic: takes per unit a tuple of arrays with a leading resample axis ([B, n_u] each; the point estimate is
    computed with B = 1) and returns [B] values. Samples are resampled with replacement within each unit."""
    arrays = [tuple(_array(a) for a in u) for u in units]
    arrays = [u for u in arrays if u[0].size]
    if not arrays:
        return math.nan, math.nan, math.nan
    with np.errstate(divide="ignore", invalid="ignore"):
        point = float(statistic([tuple(a[None, :] for a in u) for u in arrays])[0])
        if not math.isfinite(point) or min(u[0].size for u in arrays) < 2:
            return point, math.nan, math.nan
        rng = np.random.default_rng(SEED)
        draws = []
        for u in arrays:
            idx = rng.integers(0, u[0].size, size=(N_RESAMPLES, u[0].size))
            draws.append(tuple(a[idx] for a in u))
        values = statistic(draws)
    alpha = (1 - CONFIDENCE) / 2
    low, high = np.nanpercentile(values, [100 * alpha, 100 * (1 - alpha)])
    return point, float(low), float(high)


def macro_retention(units: Sequence[tuple[Sequence[float], Sequence[float], Sequence[float] | None]]) -> Estimate:
    """Mean over task units of each unit's retention; units are (policy, reference, chance-or-None) score lists."""
    data = [(_array(p), _array(r), np.zeros(len(p)) if c is None else _array(c)) for p, r, c in units]
    point, low, high = stratified(data, lambda us: np.mean([_retention(u[0], u[1], u[2]) for u in us], axis=0))
    return Estimate(point, low, high, int(sum(len(u[0]) for u in data)))


def macro_difference(units: Sequence[tuple[Sequence[float], Sequence[float], Sequence[float],
                                           Sequence[float] | None]]) -> Estimate:
    """Difference in macro retention between two systems: units are (a, b, reference, chance-or-None) scores on
    the same samples; every array is resampled with the same draws, so the comparison is paired."""
    data = [(_array(a), _array(b), _array(r), np.zeros(len(a)) if c is None else _array(c)) for a, b, r, c in units]
    point, low, high = stratified(
        data, lambda us: np.mean([_retention(a, r, c) - _retention(b, r, c) for a, b, r, c in us], axis=0))
    return Estimate(point, low, high, int(sum(len(u[0]) for u in data)))


def half_width(e: Estimate) -> float:
    return (e.high - e.low) / 2 if finite(e.low) and finite(e.high) else math.nan
