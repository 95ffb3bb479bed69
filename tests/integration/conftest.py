"""Fixtures shared by the integration tests."""

from __future__ import annotations

import pytest

from posttrain.demo.tasks import write_example_data


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """The arithmetic task's files, 32 training and 8 held-out problems (modules that need other sizes define their
    own `data`)."""
    return write_example_data(tmp_path_factory.mktemp("data"), n_train=32, n_eval=8)


@pytest.fixture
def reference_loads(monkeypatch):
    """How many frozen reference copies the run builds (one list entry per make_reference call)."""
    import posttrain.roles as reference  # where the run's roles are built

    calls = []
    real = reference.make_reference
    monkeypatch.setattr(reference, "make_reference", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls
