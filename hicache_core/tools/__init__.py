"""What only the ``hicache`` command runs: demos, benchmarks, calibration, model shapes, storage commands.

No runtime module imports this package; :mod:`hicache_core.cli` routes to it.
"""
