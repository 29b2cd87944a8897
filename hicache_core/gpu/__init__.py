"""What implementations that drive the GPU share: the Triton base, language helpers, UVA, device support.

The plugins' kernels and ``hicache bench`` import these modules; the host-pool path never does.
"""
