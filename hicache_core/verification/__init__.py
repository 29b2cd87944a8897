"""Host-tier verification: the page checksum, the verifier that takes it at backup and checks it after a load,
the batches of a load's checks, and the observer that plugs it into a pool.
"""

from ..lazy import lazy_face

# ``hicache_core.verification`` was the observer's module before the room: its names still read from here.
__getattr__, __dir__ = lazy_face(globals(), {"Verification": "observer"})
