"""``hicache bench``: the sweep, the overlap benchmark, the CPU paths, the L3 stores, and their records."""
