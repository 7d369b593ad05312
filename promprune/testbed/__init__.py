"""The prominence testbed: rendered scenes (``scenes``), a small LLaVA trained on them (``model``, ``training``,
``shipped``), its model factory (``zoo``). Importing this package is cheap: the model's code is not imported here."""

ARCH = "llava"  # the one testbed architecture
RECIPE = "v6"  # bump when the recipe changes: the cache directory and the shipped manifest carry it


def check_arch(arch: str) -> None:
    """ValueError unless ``arch`` is a testbed architecture (``testbed:<arch>``)."""
    if arch != ARCH:
        raise ValueError(f"unknown testbed arch {arch!r}; valid: {ARCH}")
