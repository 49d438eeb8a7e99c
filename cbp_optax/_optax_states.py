"""optax's state types, audited for the bias transport: by qualified name
(matched with the module), the fields holding a parameter copy, a refusal
with its reason, or a gradient statistic."""

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

# Audited against optax's sources to hold no copy of the parameters.
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

# optax wrappers' fields holding the inner state, classified by its type.
WRAPPER_FIELDS = frozenset({
    'adv_state', 'base_optimizer_state', 'fast_state', 'hyperparams_states',
    'inner_opt_state', 'inner_state', 'inner_states', 'measure_states',
    'opt_state',
})
