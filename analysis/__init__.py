"""Reports over ``moe-sim`` sweeps: collect run directories into one table, plot it, write it up.

``analysis.collect`` reads a sweep (``collect_sweep``), ``analysis.plots`` draws figures from
the collected table, ``analysis.report`` is the ``moe-report`` command.
"""
