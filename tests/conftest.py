"""Shared fixtures. Models load once per test session; the demo pair converts once per cache dir."""

from __future__ import annotations

import os

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):
    # One BLAS thread per worker: `make test` runs a worker per core, and OpenBLAS threads that spin for a core the
    # other worker holds slow both. Set before uag loads OpenBLAS, which reads it once; subprocesses inherit it.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import uag  # noqa: E402, F401  (preloads OpenBLAS before anything imports mlx)


@pytest.fixture(scope="session")
def store():
    """One ModelStore for the whole session, so each model is loaded once."""
    from uag.models.store import ModelStore

    return ModelStore()


@pytest.fixture(scope="session")
def demo_pair(store):
    """(target, drafter) of the embedded offline demo pair."""
    return store.get("demo-target"), store.get("demo-drafter")


@pytest.fixture(scope="session")
def app_session(store):
    """The app's Session on the shared store (so the API and browser tests reuse loaded models)."""
    from uag.app.session import Session

    return Session(store=store)


@pytest.fixture(scope="session")
def app_url(app_session):
    """The app served in-process on a free port."""
    from tests.support.app_server import serving

    with serving(app_session) as url:
        yield url


# --- running on several workers (pytest-xdist, `make test` runs `-n auto --dist loadgroup`) ---------------------
# Each test file is one group, so its module fixtures (a served pair, a converted model) are built once, on one
# worker; every test that needs the coder pair joins one group, so the 7 GB float32 target is loaded by one worker
# at a time and memory stays what a serial run needs. The coder group and the slowest files start first, so the
# workers finish together rather than one waiting on the other's last long file.
CODER_GROUP = "coder-pair"
SLOW_FIRST = (  # longest first, by a serial run's --durations (2026-12-02: 430 s, 287 s, … 84 s)
    CODER_GROUP,
    "tests/core/test_engine.py",
    "tests/distributed/test_sharded.py",
    "tests/server/test_server_batching.py",
    "tests/core/test_prompt_caches.py",
    "tests/app/test_adversarial_app.py",
    "tests/test_readme_commands.py",
    "tests/test_cli_adversarial.py",
    "tests/models/test_demo.py",
)


def _needs_coder_pair(item) -> bool:
    return any(
        mark.name == "skipif" and "coder pair" in str(mark.kwargs.get("reason", "")) for mark in item.iter_markers()
    )


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the groups into the tests' ids
def pytest_collection_modifyitems(config, items):
    for item in items:
        group = CODER_GROUP if _needs_coder_pair(item) else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))

    def rank(item) -> int:
        group = next(item.iter_markers("xdist_group")).args[0]
        return SLOW_FIRST.index(group) if group in SLOW_FIRST else len(SLOW_FIRST)

    items.sort(key=rank)  # stable: the order within a group and among the rest is pytest's own
