"""optax's state classes, audited against its sources for the bias transport
(§4.2, eq. 10): those holding a copy of the parameters, and where; those
refused; the wrappers' fields holding an inner state."""

import functools

import jax
import jax.numpy as jnp
import optax
import optax.experimental

# optax wrappers' fields holding the inner state, classified by its type.
WRAPPER_FIELDS = frozenset({
    'adv_state', 'base_optimizer_state', 'fast_state', 'hyperparams_states',
    'inner_opt_state', 'inner_state', 'inner_states', 'measure_states',
    'opt_state'})


@functools.cache
def optax_states() -> tuple[dict[type, tuple[str, ...]], dict[type, str]]:
  """``(fields, refused)``: each audited class's fields holding a copy of
  the parameters (``()``: statistics only); each refused class's reason."""
  o, c, agg = optax, optax.contrib, optax.experimental.aggregating
  p = {'w': jax.ShapeDtypeStruct((2,), jnp.float32)}
  built = lambda init, *a: type(jax.eval_shape(init, *a))  # no compute
  fields = dict.fromkeys((
      o.AddNoiseState, o.ApplyIfFiniteState, o.ConditionallyMaskState,
      o.ConditionallyTransformState, o.EmaState, o.EmptyState, o.FactoredState,
      o.InjectHyperparamsState, o.InjectStatefulHyperparamsState,
      o.LookaheadState, o.MaskedNode, o.MaskedState, o.MonitorState,
      o.MultiStepsState, o.PartitionState, o.ScaleByAdaDeltaState,
      o.ScaleByAdamState, o.ScaleByAdanState, o.ScaleByAmsgradState,
      o.ScaleByBacktrackingLinesearchState, o.ScaleByBeliefState,
      o.ScaleByLionState, o.ScaleByNovogradState, o.ScaleByRStdDevState,
      o.ScaleByRmsState, o.ScaleByRpropState, o.ScaleByRssState,
      o.ScaleBySM3State, o.ScaleByScheduleState, o.ScaleByZoomLinesearchState,
      o.SnapshotState, o.TraceState, o.ZeroNansState, o.ZoomLinesearchInfo,
      c.DAdaptAdamWState, c.DifferentiallyPrivateAggregateState, c.GaLoreState,
      c.HutchinsonState, c.MomoAdamState, c.MomoState, c.MuonState,
      c.ReduceLROnPlateauState, c.ScaleByAdemamixState,
      c.ScaleBySimplifiedAdEMAMixState, c.SophiaState,
      c.SplitRealAndImaginaryState,
      agg.AccumulateAvgUpdatesState, agg.PerElementMeanAndSumSqDiffGradsState,
      agg.PerElementMeanAndVarianceEMAState,
      # Not exported by optax: the classes of states built abstractly.
      built(o.scale_by_optimistic_gradient().init, p),
      built(o.scale_by_rms(bias_correction=True).init, p),
      built(o.scale_by_stddev(bias_correction=True).init, p),
      built(o.WrappedSchedule(abs).init),
      type(jax.eval_shape(o.scale_by_backtracking_linesearch(2).init, p).info),
  ), ())
  fields.update({
      c.ScheduleFreeState: ('z',), c.SAMState: ('cache',),
      c.DoGState: ('init_params',), c.DoWGState: ('init_params',),
      built(o.scale_by_distance_over_gradients().init, p): ('init_params',),
      c.MadgradState: ('x0',), c.MechanicState: ('x0',),
      c.ProdigyState: ('params0',), c.COCOBState: ('init_particles',),
      o.LookaheadParams: ('fast', 'slow'),
  })
  refused = {o.ScaleByLBFGSState: (
      'it keeps the previous parameters and a memory of parameter '
      'differences along an extra axis, which the transport does not move')}
  return fields, refused
