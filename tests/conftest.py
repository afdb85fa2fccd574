import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
# Distributed tests exercise orchestration with the eager reference update (no compile per rank);
# tests/test_kernels.py ties the fused path to the reference, and chosen tests opt into it.
os.environ.setdefault("SHARDOPT_KERNEL", "reference")

from distpool import PoolCache  # noqa: E402


@pytest.fixture(scope="module")
def pools():
    """``pools(n)`` gives this module's pool of n gloo ranks, spawned once."""
    cache = PoolCache()
    yield cache
    cache.close()
