"""Statistics of the paper's protocol (§6, "The statistical protocol").

Every head-to-head and factorial configuration is summarized as mean +- standard
deviation over seeds, with a 95% percentile-bootstrap confidence interval for
the primary quantities, and compared with the Adam reference by two-sided paired
tests (paired by seed): the t-test, checked against the Wilcoxon signed-rank
test, with Cohen's d of the per-seed differences as the effect size. p-values
are uncorrected.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import numpy as np
from scipy import stats as scipy_stats

ArrayLike = Sequence[float] | np.ndarray


class Summary(NamedTuple):
  """Mean, sample standard deviation (ddof=1) and bootstrap CI of the mean."""
  mean: float
  std: float
  ci_low: float
  ci_high: float
  n: int


class PairedTest(NamedTuple):
  """Two-sided paired comparison of ``a`` against ``b`` (differences a - b)."""
  mean_difference: float
  t_statistic: float
  t_pvalue: float
  wilcoxon_pvalue: float
  cohens_d: float
  n: int


def _finite(values: ArrayLike) -> np.ndarray:
  return np.asarray(values, dtype=np.float64)


def sample_std(values: ArrayLike) -> float:
  """Standard deviation with Bessel's correction; 0 for a single value."""
  x = _finite(values)
  return float(np.std(x, ddof=1)) if x.size > 1 else 0.0


def bootstrap_ci(
    values: ArrayLike,
    *,
    level: float = 0.95,
    resamples: int = 10_000,
    seed: int = 0,
) -> tuple[float, float]:
  """Percentile-bootstrap confidence interval of the mean.

  Resamples the seeds with replacement ``resamples`` times and takes the
  ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles of the resampled means.
  The generator is seeded, so a table is reproducible to the last digit.

  Args:
    values: one number per seed.
    level: coverage of the interval.
    resamples: number of bootstrap resamples.
    seed: seed of the resampling generator.

  Returns:
    ``(low, high)``; ``(nan, nan)`` for no values.
  """
  x = _finite(values)
  if x.size == 0:
    return math.nan, math.nan
  rng = np.random.default_rng(seed)
  indices = rng.integers(0, x.size, size=(resamples, x.size))
  means = x[indices].mean(axis=1)
  tail = (1.0 - level) / 2.0
  low, high = np.quantile(means, [tail, 1.0 - tail])
  return float(low), float(high)


def summarize(values: ArrayLike, *, level: float = 0.95) -> Summary:
  """Mean +- std with the bootstrap CI of the mean (§6 protocol)."""
  x = _finite(values)
  if x.size == 0:
    return Summary(math.nan, math.nan, math.nan, math.nan, 0)
  low, high = bootstrap_ci(x, level=level)
  return Summary(float(x.mean()), sample_std(x), low, high, int(x.size))


def paired_t_test(a: ArrayLike, b: ArrayLike) -> tuple[float, float]:
  """Two-sided paired t-test of mean(a - b) = 0: ``(t, p)``.

  ``t = mean(d) / (std(d, ddof=1) / sqrt(n))`` with ``n - 1`` degrees of
  freedom. Identical pairs give ``(0, 1)``; a constant non-zero difference
  gives ``(+-inf, 0)``.
  """
  d = _finite(a) - _finite(b)
  n = d.size
  if n < 2:
    return math.nan, math.nan
  mean, std = float(d.mean()), float(d.std(ddof=1))
  if std == 0.0:
    if mean == 0.0:
      return 0.0, 1.0
    return math.copysign(math.inf, mean), 0.0
  t = mean / (std / math.sqrt(n))
  p = 2.0 * float(scipy_stats.t.sf(abs(t), df=n - 1))
  return t, p


def wilcoxon_pvalue(a: ArrayLike, b: ArrayLike) -> float:
  """Two-sided Wilcoxon signed-rank p-value of the paired differences.

  Exact null distribution for small samples without ties (scipy's default);
  zero differences are dropped. All-zero differences give p = 1.
  """
  d = _finite(a) - _finite(b)
  if d.size == 0:
    return math.nan
  if np.all(d == 0):
    return 1.0
  return float(scipy_stats.wilcoxon(d, zero_method='wilcox').pvalue)


def cohens_d_paired(a: ArrayLike, b: ArrayLike) -> float:
  """Cohen's d of the per-seed differences: ``mean(d) / std(d, ddof=1)``.

  This is the paired effect size the paper reports ("Cohen's d on the per-seed
  differences", §6.3).
  """
  d = _finite(a) - _finite(b)
  if d.size < 2:
    return math.nan
  std = float(d.std(ddof=1))
  if std == 0.0:
    return 0.0 if float(d.mean()) == 0.0 else math.copysign(
        math.inf, float(d.mean()))
  return float(d.mean()) / std


def paired_test(a: ArrayLike, b: ArrayLike) -> PairedTest:
  """The paper's paired comparison of ``a`` against the reference ``b``."""
  a, b = _finite(a), _finite(b)
  if a.shape != b.shape:
    raise ValueError(f'paired samples differ in shape: {a.shape} vs {b.shape}')
  t, p = paired_t_test(a, b)
  return PairedTest(
      mean_difference=float(np.mean(a - b)) if a.size else math.nan,
      t_statistic=t,
      t_pvalue=p,
      wilcoxon_pvalue=wilcoxon_pvalue(a, b),
      cohens_d=cohens_d_paired(a, b),
      n=int(a.size),
  )


def format_mean_std(values: ArrayLike, digits: int = 3) -> str:
  """``'0.201 ± 0.025'``; scientific below the last digit; ``'n/a'`` if empty."""
  x = _finite(values)
  if x.size == 0:
    return 'n/a'
  if 0 < abs(x.mean()) < 10.0**-digits:  # e.g. a memorized training set
    return f'{x.mean():.2e} ± {sample_std(x):.1e}'
  return f'{x.mean():.{digits}f} ± {sample_std(x):.{digits}f}'


def format_pvalue(p: float) -> str:
  """p-values as the paper writes them (``p < 1e-6`` below that)."""
  if math.isnan(p):
    return 'n/a'
  if p < 1e-6:
    return '<1e-6'
  if p < 1e-3:
    return f'{p:.1e}'
  return f'{p:.3f}'
