"""Master-weight strategies (``master_weights=``): the public face of ``shardopt.update._master``."""
from shardopt.update._master import (STRATEGIES, FP32Master, MasterWeights, NoMaster, RemainderMaster,  # noqa: F401
                                     StochasticMaster, make_master)
