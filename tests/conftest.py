import inspect
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
# Distributed tests exercise orchestration with the eager reference update (no compile per rank);
# tests/test_kernels.py ties the fused path to the reference, and chosen tests opt into it.
os.environ.setdefault("SHARDOPT_KERNEL", "reference")

import launch  # noqa: E402
from distpool import ModulePools, PoolCache  # noqa: E402

# [Note: test tiers] Every test is in one tier, by what it starts:
#   unit   - nothing outside the test process (`make test-fast` runs those not marked ``compile``);
#   dist   - gloo ranks spawned once per session and reset per module (the ``pools`` fixture);
#   launch - real torchrun (or python) processes, marked in the module (``pytestmark``) or on the test.
# unit and dist are given here; launch is declared where the launch is.


# Within the unit tier, the tests that compile shardopt's fused kernels are also marked ``compile``:
# on a cold inductor cache each new kernel takes seconds to build, so ``make test-fast`` leaves them
# out (``make test`` runs them). A test compiles when its code asks for the fused kernels or for
# torch.compile (read from its source: nothing to keep in step by hand).
_COMPILES = ('"fused"', "'fused'", "torch.compile", "_self_check.failing", "_self_check.differences", "fused.",
             "SHARDOPT_KERNEL=fused")


def _compiles(item: pytest.Item) -> bool:
    fn = getattr(item, "function", None)
    try:
        source = inspect.getsource(fn) if fn is not None else ""
    except (OSError, TypeError):
        return False
    return any(marker in source for marker in _COMPILES)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("launch"):
            continue
        if "pools" in item.fixturenames:
            item.add_marker(pytest.mark.dist)
            continue
        item.add_marker(pytest.mark.unit)
        if _compiles(item):
            item.add_marker(pytest.mark.compile)


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:  # noqa: ANN001
    """Launches run again because gloo aborted them at exit (tests/launch.py), never hidden."""
    retried = launch.RETRIED
    terminalreporter.write_line(f"launches run again after gloo aborted at exit: {len(retried)}"
                                + (f" ({', '.join(retried)})" if retried else ""))


@pytest.fixture(scope="session")
def _shared_pools():
    cache = PoolCache()
    yield cache
    cache.close()


@pytest.fixture(scope="module")
def pools(_shared_pools):
    """``pools(n)`` gives a pool of n gloo ranks, spawned once per session and put back as fresh
    ranks for each module (see distpool [Note: pools shared by the modules])."""
    yield ModulePools(_shared_pools)


@pytest.fixture(scope="module")
def one_rank_group():
    """A world of one gloo rank inside the test process, for the unit tier (spawned ranks cost
    seconds; this costs milliseconds). Uses the group already there, if another module made one."""
    import tempfile

    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(d, "store"), 1), rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()
