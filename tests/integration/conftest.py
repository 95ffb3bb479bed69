"""Fixtures shared by the integration tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def reference_loads(monkeypatch):
    """How many frozen reference copies the run builds (one list entry per make_reference call)."""
    import posttrain.models.reference as reference

    calls = []
    real = reference.make_reference
    monkeypatch.setattr(reference, "make_reference", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls
