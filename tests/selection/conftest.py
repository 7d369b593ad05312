"""Fixtures shared by the selection tests."""
import pytest

from promprune.selection import certified


@pytest.fixture
def graphs_schedule(monkeypatch):
    """Eager calls on the stage schedule CUDA graphs take (``certified.schedule`` opens every eager call with the
    lead, graphs only from ``LEAD_FROM``): both paths then run the same Lanczos steps, so a test can ask for the same
    values from both, the entropies (their brackets' midpoints) included."""
    schedule = certified.schedule
    monkeypatch.setattr(certified, "schedule", lambda views, n, eager=True: schedule(views, n, eager=False))
