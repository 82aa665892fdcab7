"""Whether a policy ranking transfers across models: retentions by joint bootstrap, Kendall τ and flipped pairs.

Each model's samples are its own (RULER lengths count the model's tokens, so the prompts differ), so each model is
resampled on its own: one draw resamples that model's samples within each task unit, with the same indices for every
policy and the reference (the comparisons within a model stay paired), and recomputes every policy's macro retention
(chance-corrected, as harness.reporting.uncertainty). A draw of the pair of models then gives one τ between the two
rankings (scipy.stats.kendalltau, τ-b: ties count as ties) and one retention difference per pair of policies and
model. Intervals are 95 % percentiles over draws; a draw whose τ is undefined (a ranking all ties) is left out.
A pair of policies flips when its order on one model is the reverse of its order on the other; the flip is supported
when each model's paired difference interval excludes 0.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from scipy import stats

from harness.reporting import uncertainty as unc
from harness.reporting.uncertainty import Estimate

Unit = tuple[np.ndarray, np.ndarray, np.ndarray]      # policy scores [P, n], reference [n], chance [n]


@dataclass
class ModelScores:
    """One model's per-sample scores of the policies compared (same order on every model) and of its reference."""

    policies: list[str]
    units: list[Unit]

    @property
    def n(self) -> int:
        return int(sum(u[1].size for u in self.units))


@dataclass
class Draws:
    """One model's macro retention and mean score per policy: the point [P] and the bootstrap draws [B, P]; the
    reference's mean score: the point and its draws [B]."""

    retention: np.ndarray
    retention_draws: np.ndarray
    score: np.ndarray
    score_draws: np.ndarray
    n: int
    reference: float = math.nan
    reference_draws: np.ndarray = field(default_factory=lambda: np.full(1, math.nan))


@dataclass(frozen=True)
class Flip:
    a: str
    b: str
    difference: dict[str, Estimate]       # per model: retention(a) − retention(b), paired within the model
    supported: bool                       # each model's interval excludes 0


def _stats(units: Sequence[Unit], idx: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Macro retention and mean score per policy for index draws idx[u] [B, n_u] (two [B, P] arrays), and the
    reference's mean score [B] (means over units, unweighted)."""
    rets, scores, refs = [], [], []
    for (p, r, c), i in zip(units, idx):
        pm, rm, cm = p[:, i].mean(-1), r[i].mean(-1), c[i].mean(-1)        # [P, B], [B], [B]
        with np.errstate(divide="ignore", invalid="ignore"):
            rets.append((pm - cm) / (rm - cm))
        scores.append(pm)
        refs.append(rm)
    return np.mean(rets, 0).T, np.mean(scores, 0).T, np.mean(refs, 0)


def draw(model: ModelScores, resamples: int = unc.N_RESAMPLES, seed: int = unc.SEED) -> Draws:
    """The model's point retentions and scores, and `resamples` stratified, paired bootstrap draws of them."""
    units = [u for u in model.units if u[1].size]
    if not units:
        empty = np.full(len(model.policies), math.nan)
        return Draws(empty, empty[None, :], empty, empty[None, :], 0)
    ret, score, ref = _stats(units, [np.arange(u[1].size)[None, :] for u in units])
    rng = np.random.default_rng(seed)
    idx = [rng.integers(0, u[1].size, size=(resamples, u[1].size)) for u in units]
    ret_draws, score_draws, ref_draws = _stats(units, idx)
    return Draws(ret[0], ret_draws, score[0], score_draws, int(sum(u[1].size for u in units)), float(ref[0]),
                 ref_draws)


def _interval(values: np.ndarray) -> tuple[float, float]:
    finite = values[np.isfinite(values)]
    if finite.size < 2:
        return math.nan, math.nan
    alpha = 100 * (1 - unc.CONFIDENCE) / 2
    low, high = np.percentile(finite, [alpha, 100 - alpha])
    return float(low), float(high)


def estimate(point: float, values: np.ndarray, n: int) -> Estimate:
    return Estimate(float(point), *_interval(values), n) if math.isfinite(point) else Estimate(math.nan, math.nan,
                                                                                              math.nan, n)


def kendall(x: Sequence[float] | np.ndarray, y: Sequence[float] | np.ndarray) -> float:
    """Kendall's τ-b of two rankings (NaN when either is all ties or holds a NaN)."""
    a, b = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if a.size < 2 or not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
        return math.nan
    if np.all(a == a[0]) or np.all(b == b[0]):
        return math.nan
    return float(stats.kendalltau(a, b).statistic)


def tau(a: Draws, b: Draws) -> Estimate:
    """τ between two models' retention rankings, with its bootstrap interval (n: the policies ranked)."""
    values = np.array([kendall(x, y) for x, y in zip(a.retention_draws, b.retention_draws)])
    return estimate(kendall(a.retention, b.retention), values, int(a.retention.size))


def flips(policies: Sequence[str], draws: Mapping[str, Draws]) -> list[Flip]:
    """Pairs of policies whose retention order on the first model is the reverse of that on the second."""
    (ma, da), (mb, db) = list(draws.items())[:2]
    out = []
    for i, j in itertools.combinations(range(len(policies)), 2):
        diff = {m: estimate(d.retention[i] - d.retention[j], d.retention_draws[:, i] - d.retention_draws[:, j], d.n)
                for m, d in ((ma, da), (mb, db))}
        x, y = diff[ma].value, diff[mb].value
        if math.isfinite(x) and math.isfinite(y) and x * y < 0:
            out.append(Flip(policies[i], policies[j], diff, all(e.excludes(0.0) for e in diff.values())))
    return out
