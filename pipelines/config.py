"""Configuration shared by a sweep spec and the components it configures: a spec section *is* the component's own
config object (``model:`` is a ``pipelines.weights.ModelSource``, ``resources:`` a :class:`Resources`), so nothing
is copied field by field between them."""
from __future__ import annotations

from dataclasses import dataclass

AUTO = "auto"


@dataclass
class Resources:
    """How an evaluation runs on the cluster (the spec's ``resources:`` section)."""

    workers: int | str = AUTO  # actors per evaluation; auto: spread the GPUs over the trials, 1 on CPU
    gpus_per_worker: float = 1  # a 7B model in bf16 fits one 24+ GB GPU; ignored when the cluster has no GPU
    cpus_per_worker: float = 1  # image decoding and the processor are light; one core keeps 2-core laptops usable
    batch_size: int = 8  # rows per map_batches call and per generate(); 8 fits a 7B model on a 24 GB GPU
    actor_wait_s: float = 600  # DataContext.wait_for_min_actors_s: an unschedulable pool fails after this long
    # publish the weights to the object store once per sweep (see docs/pipeline.md: weight loading)
    share_weights: bool = True

    @property
    def actors(self) -> int:
        """The actor pool's size (``auto`` outside a sweep's plan: one actor)."""
        return 1 if self.workers == AUTO else int(self.workers)
