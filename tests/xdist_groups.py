"""`--dist loadgroup` that groups again under pytest 9.

pytest-xdist 3.8 tells its controller a test's `xdist_group` by appending "@group" to the node id on the
worker, through a field pytest 9 no longer reads (pytest-dev/pytest-xdist#1386): every group was silently
ignored, so the Slurm tests ran on both workers at once, queueing behind each other's jobs, and a module's
shared fixture was computed on both. Here each worker writes the groups of its collection to a file in a
folder the controller made, and the controller's scheduler splits the collection by that file (node ids
that already carry an "@group", as under older pytest, are split as xdist does).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest

WORKER_KEY = "spartron_xdist_groups"  # workerinput key: the folder the workers write their groups to
FOLDER = pytest.StashKey[Path]()  # the controller's folder


def group_of(item: pytest.Item) -> str | None:
    """The group xdist would give `item` (its xdist_group names, sorted and joined), or None."""
    names = {str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in item.iter_markers("xdist_group")}
    return "_".join(sorted(names)) if names else None


def write_groups(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On a worker: record {node id: group} of this collection for the controller's scheduler."""
    folder = getattr(config, "workerinput", {}).get(WORKER_KEY)
    if folder is not None:
        groups = {item.nodeid: group for item in items if (group := group_of(item)) is not None}
        path = Path(folder) / f"{config.workerinput['workerid']}.json"
        path.with_suffix(".tmp").write_text(json.dumps(groups))
        path.with_suffix(".tmp").replace(path)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:  # noqa: ANN001 - xdist's WorkerController
    if FOLDER not in node.config.stash:
        node.config.stash[FOLDER] = Path(tempfile.mkdtemp(prefix="spartron-xdist-groups-"))
    node.workerinput[WORKER_KEY] = str(node.config.stash[FOLDER])


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):  # noqa: ANN001, ANN201 - xdist's types
    if config.getvalue("dist") != "loadgroup" or FOLDER not in config.stash:
        return None
    from xdist.scheduler import LoadGroupScheduling

    folder = config.stash[FOLDER]

    class FileGroupScheduling(LoadGroupScheduling):
        """LoadGroupScheduling whose work units are the groups the workers wrote (read once, when the
        collection is complete and the controller splits it)."""

        def _split_scope(self, nodeid: str) -> str:
            if not hasattr(self, "groups"):
                written = sorted(folder.glob("*.json"))
                self.groups = json.loads(written[0].read_text()) if written else {}
            return self.groups.get(nodeid) or super()._split_scope(nodeid)

    return FileGroupScheduling(config, log)


def pytest_unconfigure(config: pytest.Config) -> None:
    if FOLDER in config.stash:
        shutil.rmtree(config.stash[FOLDER], ignore_errors=True)
