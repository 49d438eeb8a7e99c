"""optax's state types, audited for the bias transport.

Each state type of optax, optax.contrib, optax.transforms and
optax.schedules is classified by qualified name (matched with its module, so
that a user's type of the same name is not): the fields that hold a copy of
the parameters, a refusal with its reason, or a gradient statistic. The
transport (:mod:`cbp_optax._opt_state`) moves the copies, refuses the
refused, and leaves the statistics.
"""

# optax's state types holding a copy of the parameters, by qualified name:
# matched with the module too, so a user's type of the same name is not.
OPTAX_PARAMETER_FIELDS = {
    'ScheduleFreeState': ('z',),
    'SAMState': ('cache',),
    'DoGState': ('init_params',),
    'DoWGState': ('init_params',),
    'ScaleByDistanceOverGradientsState': ('init_params',),
    'MadgradState': ('x0',),
    'MechanicState': ('x0',),
    'ProdigyState': ('params0',),
    'COCOBState': ('init_particles',),
    'LookaheadParams': ('fast', 'slow'),
}

OPTAX_REFUSED = {
    'ScaleByLBFGSState': (
        'it keeps the previous parameters and a memory of parameter '
        'differences along an extra axis, which the transport does not move'
    ),
}

# optax's state types audited (against their sources) to hold no copy of the
# parameters: gradient statistics (momenta such as ``trace`` included),
# counters, schedules, and wrappers of inner states. With the two tables
# above, this classifies every state type of optax, optax.contrib,
# optax.transforms and optax.schedules.
OPTAX_STATISTICS = frozenset({
    'AccumulateAvgUpdatesState', 'AddNoiseState', 'ApplyIfFiniteState',
    'BacktrackingLinesearchInfo', 'ConditionallyMaskState',
    'ConditionallyTransformState', 'DAdaptAdamWState',
    'DifferentiallyPrivateAggregateState', 'EmaState', 'EmptyState',
    'FactoredState', 'GaLoreState', 'HutchinsonState',
    'InjectHyperparamsState', 'InjectStatefulHyperparamsState',
    'LookaheadState', 'MaskedNode', 'MaskedState', 'MomoAdamState',
    'MomoState', 'MonitorState', 'MultiStepsState', 'MuonState',
    'PartitionState', 'PerElementMeanAndSumSqDiffGradsState',
    'PerElementMeanAndVarianceEMAState', 'ReduceLROnPlateauState',
    'ScaleByAdaDeltaState', 'ScaleByAdamState', 'ScaleByAdanState',
    'ScaleByAdemamixState', 'ScaleByAmsgradState',
    'ScaleByBacktrackingLinesearchState', 'ScaleByBeliefState',
    'ScaleByLionState', 'ScaleByNovogradState',
    'ScaleByOptimisticGradientState', 'ScaleByRStdDevState',
    'ScaleByRStdDevWithCountState', 'ScaleByRmsState',
    'ScaleByRmsWithCountState', 'ScaleByRpropState', 'ScaleByRssState',
    'ScaleBySM3State', 'ScaleByScheduleState',
    'ScaleBySimplifiedAdEMAMixState', 'ScaleByTrustRatioState',
    'ScaleByZoomLinesearchState', 'SnapshotState', 'SophiaState',
    'SplitRealAndImaginaryState', 'TraceState', 'WrappedScheduleState',
    'ZeroNansState',
    'ZoomLinesearchInfo',
})

# Fields of optax's wrappers that hold the inner optimizer's state: what they
# hold is classified by its own type, not as a statistic of the wrapper.
WRAPPER_FIELDS = frozenset({
    'adv_state', 'base_optimizer_state', 'fast_state', 'hyperparams_states',
    'inner_opt_state', 'inner_state', 'inner_states', 'measure_states',
    'opt_state',
})
