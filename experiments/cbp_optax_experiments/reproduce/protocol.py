"""The §6 training protocol shared by Tables 6, 7 and 8.

For each method: every rate of the common grid over all seeds (one vmapped
jit), discard a rate on which any seed went non-finite, select the rate with
the lowest mean final validation loss, and report that rate's per-seed final
training loss (full training set), test loss, test accuracy and iterations to
a smoothed training loss below the threshold. Comparisons against the
reference method are paired by seed.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional, Sequence

import numpy as np
import tqdm

from cbp_optax_experiments.reproduce import plotting
from cbp_optax_experiments.reproduce import stats
from cbp_optax_experiments.reproduce import training


@dataclasses.dataclass
class Outcome:
  """A method at its selected rate; per-seed arrays."""
  name: str
  learning_rate: Optional[float]
  train_loss: np.ndarray
  test_loss: np.ndarray
  test_accuracy: np.ndarray
  iterations: np.ndarray            # inf where the threshold was never reached
  smoothed_curves: np.ndarray       # (seed, steps)
  test_accuracy_curves: np.ndarray  # (seed, evals)
  eval_steps: np.ndarray
  validation_profile: dict          # lr -> mean final val loss (None: discarded)


def censored_iterations(iterations: np.ndarray, budget: int) -> np.ndarray:
  """Censored runs count as the budget in means (stated in the tables)."""
  return np.where(np.isfinite(iterations), iterations, budget)


# recipe key -> RunResult of the whole grid (see run_method).
_RESULTS: dict = {}


def run_method(
    method: training.Method,
    model_for: Callable[[bool], object],
    data: training.Dataset,
    config: training.TrainConfig,
    seeds: Sequence[int],
    grid: Sequence[float],
    threshold: float,
) -> Outcome:
  """Grid, discard rule, selection and per-seed metrics of one method.

  Runs of a method with a ``recipe`` are computed once per process for the
  same network, data, budget, seeds and grid: Table 7's M1, M2, M3, M1 + M2
  and M1 + M2 + M3 cells are Table 6's CBP-M1, CBP-M2, CBP-M3, CBP-M1M2 and
  CBP (full) arms, so ``reproduce all`` trains them once.
  """
  model = model_for(method.centered)
  key = None
  if method.recipe is not None:
    key = (method.recipe, method.centered, repr(model), config, tuple(seeds),
           tuple(grid), data.description)
  result = _RESULTS.get(key) if key is not None else None
  if result is None:
    result = training.run_grid(model, method, data, config, seeds, grid)
    if key is not None:
      _RESULTS[key] = result
  keep = training.all_finite(result, axis=0)
  profile = {
      lr: (float(result.val_loss[:, i, -1].mean()) if keep[i] else None)
      for i, lr in enumerate(grid)
  }
  index = training.select_learning_rate(result)
  if index is None:
    nan = np.full(len(seeds), np.nan)
    return Outcome(method.name, None, nan, nan, nan, np.full(len(seeds), np.inf),
                   np.full((len(seeds), config.steps), np.nan),
                   np.full((len(seeds), len(result.eval_steps[0, 0])), np.nan),
                   result.eval_steps[0, 0], profile)
  pick = lambda a: np.asarray(a[:, index])
  losses = pick(result.losses)
  return Outcome(
      name=method.name,
      learning_rate=float(grid[index]),
      train_loss=pick(result.train_loss)[:, -1],
      test_loss=pick(result.test_loss)[:, -1],
      test_accuracy=pick(result.test_accuracy)[:, -1],
      iterations=training.iterations_to(losses, threshold),
      smoothed_curves=training.smoothed(losses),
      test_accuracy_curves=pick(result.test_accuracy),
      eval_steps=result.eval_steps[0, 0],
      validation_profile=profile,
  )


def run_methods(methods, model_for, data, config, seeds, grid, threshold, *,
                progress: bool, description: str) -> list[Outcome]:
  outcomes = []
  for method in tqdm.tqdm(methods, desc=description, disable=not progress,
                          unit='method'):
    outcomes.append(run_method(method, model_for, data, config, seeds, grid,
                               threshold))
  return outcomes


def format_iterations(iterations: np.ndarray, budget: int) -> str:
  censored = int(np.sum(~np.isfinite(iterations)))
  values = censored_iterations(iterations, budget)
  text = stats.format_mean_std(values, 0)
  return text + (f' ({censored} censored)' if censored else '')


def results_table(
    outcomes: Sequence[Outcome],
    reference: Optional[str],
    budget: int,
    paper: dict,
    threshold: float,
) -> tuple[str, dict]:
  """Markdown table (ours next to the paper) and the paired tests vs reference."""
  by_name = {o.name: o for o in outcomes}
  ref = by_name.get(reference) if reference else None
  rows, tests = [], {}
  for o in outcomes:
    iters = censored_iterations(o.iterations, budget)
    loss_summary = stats.summarize(o.train_loss)
    iter_summary = stats.summarize(iters)
    row = [
        o.name,
        paper.get(o.name, {}).get('lr', ''),
        'discarded' if o.learning_rate is None else f'{o.learning_rate:g}',
        paper.get(o.name, {}).get('loss', ''),
        stats.format_mean_std(o.train_loss),
        f'[{loss_summary.ci_low:.3f}, {loss_summary.ci_high:.3f}]',
        f'{np.mean(o.test_loss):.3f}',
        paper.get(o.name, {}).get('acc', ''),
        stats.format_mean_std(o.test_accuracy),
        paper.get(o.name, {}).get('iters', ''),
        format_iterations(o.iterations, budget),
        f'[{iter_summary.ci_low:.0f}, {iter_summary.ci_high:.0f}]',
    ]
    if ref is not None and o is not ref:
      loss_test = stats.paired_test(o.train_loss, ref.train_loss)
      iter_test = stats.paired_test(
          iters, censored_iterations(ref.iterations, budget))
      tests[o.name] = {'train_loss': loss_test._asdict(),
                       'iterations': iter_test._asdict()}
      row += [f'{stats.format_pvalue(loss_test.t_pvalue)} / '
              f'{stats.format_pvalue(loss_test.wilcoxon_pvalue)} / '
              f'{loss_test.cohens_d:+.1f}',
              f'{stats.format_pvalue(iter_test.t_pvalue)} / '
              f'{stats.format_pvalue(iter_test.wilcoxon_pvalue)} / '
              f'{iter_test.cohens_d:+.1f}']
    elif ref is not None:
      row += ['reference', 'reference']
    rows.append(row)
  header = ['method', 'l.r. paper', 'l.r. ours', 'train loss paper',
            'train loss ours', 'CI95', 'test loss', 'test acc. paper',
            'test acc. ours', f'iters@{threshold:g} paper',
            f'iters@{threshold:g} ours', 'CI95']
  if ref is not None:
    header += [f'loss vs {reference}: p(t) / p(W) / d',
               f'iters vs {reference}: p(t) / p(W) / d']
  return plotting.markdown_table(header, rows), tests


def outcome_json(o: Outcome) -> dict:
  return {
      'learning_rate': o.learning_rate,
      'train_loss': o.train_loss, 'test_loss': o.test_loss,
      'test_accuracy': o.test_accuracy, 'iterations': o.iterations,
      'validation_profile': o.validation_profile,
  }


def profile_table(outcomes: Sequence[Outcome], grid: Sequence[float]) -> str:
  """Mean final validation loss per rate ("discarded" for non-finite)."""
  rows = []
  for o in outcomes:
    rows.append([o.name] + [
        'discarded' if o.validation_profile[lr] is None else
        f'{o.validation_profile[lr]:.3f}' for lr in grid])
  return plotting.markdown_table(['method'] + [f'{lr:g}' for lr in grid], rows)


def plot_curves(outcomes: Sequence[Outcome], path, title: str) -> None:
  """Smoothed training loss and test accuracy: median and IQR over seeds."""
  fig, axes = plotting.new_axes(1, 2)
  for i, o in enumerate(outcomes):
    if o.learning_rate is None:
      continue
    color = f'C{i % 10}'
    style = '-' if i < 10 else '--'
    steps = np.arange(1, o.smoothed_curves.shape[1] + 1)
    plotting.band(axes[0], steps, o.smoothed_curves, o.name, color=color,
                  ls=style, lw=1)
    plotting.band(axes[1], o.eval_steps, o.test_accuracy_curves, o.name,
                  color=color, ls=style, lw=1)
  axes[0].set_yscale('log')
  axes[0].set_xlabel('iteration')
  axes[0].set_ylabel('smoothed training loss')
  axes[0].set_title(f'(a) {title}')
  axes[1].set_xlabel('iteration')
  axes[1].set_ylabel('test accuracy')
  axes[1].set_ylim(0.3, 1.0)
  axes[1].set_title('(b) test accuracy')
  axes[1].legend(fontsize=6, ncol=2)
  plotting.save(fig, path)


def finite_fraction(values: np.ndarray) -> float:
  values = np.asarray(values, np.float64)
  return float(np.mean(np.isfinite(values))) if values.size else math.nan
