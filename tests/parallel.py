"""How ``make test`` spreads the suite over pytest-xdist workers (``-n auto --dist loadfile``): a module's tests run
in one worker, so its module fixtures (checkpoints, ONNX graphs, servers) are built once, and the modules that use
the session's shipped-checkpoint :func:`~tests.conftest.server` run in one worker together, so that one worker
starts that server (a minute of exporting and warming up), not each worker that runs such a module.

Imports pytest-xdist (a dev dependency, which ``make test`` installs); ``tests/conftest.py`` registers it unless
xdist is disabled (``-p no:xdist``), and without ``--dist loadfile`` it only checks the collected tests."""

from __future__ import annotations

from collections import Counter

import pytest
from xdist.scheduler import LoadFileScheduling

#: the modules whose tests use the session ``server``; the suite refuses to run if another one does and is not here
#: (:func:`check_server_modules`): it would start a second server in another worker
SERVER_MODULES = frozenset({"tests/test_demo_browser.py", "tests/test_hostile_images.py", "tests/test_service.py",
                            "tests/test_serving_http.py"})
SERVER_GROUP = "modules using the shipped-checkpoint server"


class ModulesWithTheServerTogether(LoadFileScheduling):
    """xdist's file scheduling, with :data:`SERVER_MODULES` as one unit of work."""

    def _split_scope(self, nodeid: str) -> str:
        module = super()._split_scope(nodeid)
        return SERVER_GROUP if module in SERVER_MODULES else module


class Scheduling:
    """The plugin: xdist asks every plugin for a scheduler, and this one answers for ``--dist loadfile``; the
    collected tests are checked (and their IDs mended) before xdist hands them out."""

    @pytest.hookimpl
    def pytest_xdist_make_scheduler(self, config: pytest.Config, log) -> LoadFileScheduling | None:
        return ModulesWithTheServerTogether(config, log) if config.getvalue("dist") == "loadfile" else None

    @pytest.hookimpl
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        give_each_item_its_node_id(items)
        check_server_modules(items)


def give_each_item_its_node_id(items: list[pytest.Item]) -> None:
    """xdist hands tests to workers by node ID, and of tests that share one it runs one.  schemathesis (4.x) names
    each API operation's test ``test_x[POST /caption]`` but, under pytest 9, which takes an ID's brackets from a
    parametrization schemathesis does not use, gives them all the ID ``…::test_x``: each gets its name as its ID.
    Any ID still shared refuses the suite rather than letting xdist run part of it."""
    for item in items:
        node_id = getattr(item, "id", None)  # pytest 9's structured ID; pytest 8 made the ID from the name
        if isinstance(item, pytest.Function) and node_id is not None and node_id.params is None \
                and item.name != item.originalname:
            item._id = node_id.with_params(item.name.removeprefix(f"{item.originalname}[").removesuffix("]"))
    shared = sorted(nodeid for nodeid, count in Counter(item.nodeid for item in items).items() if count > 1)
    if shared:
        raise pytest.UsageError(f"tests that share a node ID (xdist would run one of each): {shared}")


def check_server_modules(items: list[pytest.Item]) -> None:
    """Refuse a suite in which a module outside :data:`SERVER_MODULES` uses the session ``server``."""
    using = {item.nodeid.split("::", 1)[0] for item in items if "server" in item.fixturenames}
    if using - SERVER_MODULES:
        raise pytest.UsageError(f"{sorted(using - SERVER_MODULES)} use the session `server`: add them to "
                                "tests/parallel.py's SERVER_MODULES, so that one xdist worker runs them all")
