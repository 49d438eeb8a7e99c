"""``cbp-optax workloads``: time to target against the optimizers users pick.

An AlgoPerf-style suite at CPU size: fixed workloads (``definitions``), the
optimizer arms (``arms``), the tuning / evaluation protocol and the
performance-profile score (``protocol``, ``scoring``), and the report
(``report``). The core library never imports this package.
"""
