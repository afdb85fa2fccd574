import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from distpool import PoolCache  # noqa: E402


@pytest.fixture(scope="module")
def pools():
    """``pools(n)`` gives this module's pool of n gloo ranks, spawned once."""
    cache = PoolCache()
    yield cache
    cache.close()
