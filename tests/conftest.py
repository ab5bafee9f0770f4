"""Shared fixtures. Models load once per test session; the demo pair converts once per cache dir."""

from __future__ import annotations

import pytest

import uag  # noqa: F401  (preloads OpenBLAS before anything imports mlx)


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
