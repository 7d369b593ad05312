"""Training recipes for the offline models (the adapters in ``promprune.models`` never import this package: its
models are found by name through ``promprune.models.factories``)."""
