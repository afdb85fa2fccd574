"""Adam moment formats (``moments=``): the public face of ``shardopt.update._moments``."""
from shardopt.update._moments import (MOMENTS, MUON_MOMENTS, BF16Moments, FP32Moments, Int8Moments, Moments,  # noqa: F401
                                      MuonMomentum, make_moments, moment_alignment)
