"""The invariants every promprune method satisfies, checked on largest_norm: `pytest test_largest_norm.py`."""
import largest_norm  # noqa: F401  (registers the method)
from promprune.testing import check_method


def test_largest_norm():
    check_method("largest_norm")
