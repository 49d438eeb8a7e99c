"""The any-time score's ladder of targets and per-run values (``scoring``),
against values worked out by hand."""

import math

import numpy as np
import pytest

from cbp_optax_experiments.workloads import scoring


def test_best_so_far_ignores_missing_and_non_finite_values():
  got = scoring.best_so_far([0.2, None, 0.1, math.nan, 0.5, 0.4], True)
  np.testing.assert_array_equal(got, [0.2, 0.2, 0.2, 0.2, 0.5, 0.5])
  got = scoring.best_so_far([3.0, 4.0, 2.0, math.inf], False)
  np.testing.assert_array_equal(got, [3.0, 3.0, 2.0, 2.0])


def test_ladder_easy_end_is_the_references_median_best_so_far():
  # Eight evaluations; the reference's three seeds rise at different speeds.
  curves = [[0.1 * (k + 1) for k in range(8)],
            [0.05 * (k + 1) for k in range(8)],
            [0.2 * (k + 1) for k in range(8)]]
  best = {'adamw': [0.8, 0.4, 1.6], 'other': [2.0, 2.0, 2.0]}
  targets = scoring.ladder(curves, [False] * 3, best, True,
                           fractions=(0.25, 0.5, 1.0), hard=2)
  # Fractions 1/4, 1/2, 1 of 8 evaluations: the 2nd, 4th and 8th; the
  # median of three seeds is the middle one (the 0.1 slope).
  assert targets[:3] == pytest.approx([0.2, 0.4, 0.8])
  # Hard end: from the reference's final 0.8 to the best median (2.0) in
  # two equal steps.
  assert targets[3:] == pytest.approx([1.4, 2.0])


def test_ladder_of_an_even_seed_count_takes_the_worse_middle_value():
  curves = [[1.0], [2.0], [3.0], [4.0]]
  targets = scoring.ladder(curves, [False] * 4, {'adamw': [1, 2, 3, 4]},
                           True, fractions=(1.0,), hard=1)
  assert targets == [2.0, 2.0]   # at least half the seeds reach it
  # Lower is better: the worse middle value is the larger one.
  targets = scoring.ladder(curves, [False] * 4, {'adamw': [1, 2, 3, 4]},
                           False, fractions=(1.0,), hard=1)
  assert targets == [3.0, 3.0]


def test_ladder_is_monotone_and_a_diverged_reference_seed_reaches_nothing():
  curves = [[0.5, 0.9], [0.6, 0.9], [0.7, 0.9]]
  targets = scoring.ladder(curves, [False] * 3, {'adamw': [0.9] * 3},
                           True, fractions=(0.5, 1.0), hard=2)
  assert targets == pytest.approx([0.6, 0.9, 0.9, 0.9])
  # Two seeds diverged: the reference's median reaches nothing, and every
  # target is the best arm's median quality.
  targets = scoring.ladder(curves, [True, True, False],
                           {'adamw': [None, None, 0.9], 'b': [0.8] * 3},
                           True, fractions=(0.5, 1.0), hard=2)
  assert targets == [0.8] * 4
  assert scoring.ladder([], [], {}, True) == []


def test_anytime_value_counts_the_evaluations_at_or_past_each_target():
  curve = [0.1, 0.3, 0.6, 0.5, 0.9]          # n = 5
  # 0.3 first reached at evaluation 2: 4 of 5; 0.9 at 5: 1 of 5; 2.0 never.
  assert scoring.anytime_value(curve, [0.3], True, False) == pytest.approx(0.8)
  assert scoring.anytime_value(curve, [0.9], True, False) == pytest.approx(0.2)
  assert scoring.anytime_value(curve, [2.0], True, False) == 0.0
  assert scoring.anytime_value(curve, [0.3, 0.9, 2.0], True, False) == (
      pytest.approx((0.8 + 0.2) / 3))
  # A diverged run reaches nothing; lower-is-better metrics read downwards.
  assert scoring.anytime_value(curve, [0.3], True, True) == 0.0
  assert scoring.anytime_value([5.0, 3.0, 1.0], [3.0], False,
                               False) == pytest.approx(2 / 3)


def test_anytime_value_in_wall_clock_charges_the_step_cost():
  curve = [0.0, 1.0, 1.0, 1.0]               # reached at evaluation 2 of 4
  assert scoring.anytime_value(curve, [1.0], True, False, 1.0) == 0.75
  # Twice AdamW's step cost: at AdamW's 4th evaluation time, 1 of 4 left.
  assert scoring.anytime_value(curve, [1.0], True, False, 2.0) == 0.25
  # Three times: past AdamW's budget, nothing.
  assert scoring.anytime_value(curve, [1.0], True, False, 3.0) == 0.0
  # Half the cost: reached by AdamW's first evaluation time.
  assert scoring.anytime_value(curve, [1.0], True, False, 0.5) == 1.0


def test_reach_fractions_per_target():
  curves = [[0.1, 0.5], [0.2, 0.9], [0.9, 0.9]]
  got = scoring.reach_fractions(curves, [False, False, True], [0.5, 0.9],
                                True)
  assert got == pytest.approx([2 / 3, 1 / 3])
