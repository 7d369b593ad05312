"""Fixtures shared by the eval tests."""
import pytest

STANDIN_DOCS = 6  # documents per hub-task stand-in: even (MME pairs), a few batches, quick on a 2-core CPU


@pytest.fixture(scope="session")
def hub_standins(tmp_path_factory):
    """An HF_HOME holding stand-ins of the paper's nine hub datasets (built once per session). It changes no
    environment by itself: use ``with promprune.eval.standins.serving(hub_standins):`` where the tasks should load."""
    from promprune.eval.standins import build_standins

    return build_standins(tmp_path_factory.mktemp("hf_home"), docs_per_task=STANDIN_DOCS, seed=0)
