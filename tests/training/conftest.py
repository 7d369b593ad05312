"""The model tests' images and prompts (the training recipe answers about the same kind of inputs)."""
from ..models.conftest import images, prompts  # noqa: F401
