"""Suite-wide collection rules.

Tests marked `slurm` share one single-machine Slurm of 2 nodes (scripts/slurm.sh): under pytest-xdist
(`-n 2 --dist loadgroup`, which scripts/test.sh passes on) they all go to one worker, so their jobs never
queue behind each other's and their timings hold.
"""

from __future__ import annotations

import pytest


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("slurm") is not None:
            item.add_marker(pytest.mark.xdist_group("slurm"))
