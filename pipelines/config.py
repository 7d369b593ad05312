"""Configuration shared by a sweep spec and the components it configures: a spec section *is* the component's own
config object (``model:`` is a ``pipelines.weights.ModelSource``, ``resources:`` a :class:`Resources`), so nothing
is copied field by field between them.

Each section is a plain dataclass whose field annotations carry their own rules (pydantic's ``Field`` constraints,
``Literal`` choices, strict numbers), so a field is declared once: its type, its check, its default. Code builds
the dataclasses directly, unchecked; ``pipelines.spec`` validates a spec's sections through pydantic. The helpers
below say what a field expects in the spec's own words (``expect``), so every problem reads
``resources.workers: expected an int >= 1 or 'auto', got 0`` rather than pydantic's union-by-union report.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import AllowInfNan, ConfigDict, Field, StrictFloat, StrictInt, ValidationError, WrapValidator, \
    with_config
from pydantic_core import PydanticCustomError

AUTO = "auto"

# a bool is never a number and a float never an int; a number stays as written (2 is not turned into 2.0)
Number = StrictInt | Annotated[StrictFloat, AllowInfNan(False)]
SECTION = ConfigDict(extra="forbid")  # an unknown key in a section is an error (with a did-you-mean)


def problem(text: str) -> PydanticCustomError:
    """A spec problem in our words; `pipelines.spec` prefixes it with the field's dotted path."""
    return PydanticCustomError("spec", "{text}", {"text": text})


def expect(what: str) -> WrapValidator:
    """Report any failure of the annotated field (type, constraint, every union member) as one problem:
    ``expected <what>, got <value>``."""
    def check(value: Any, handler):
        try:
            return handler(value)
        except ValidationError:
            raise problem(f"expected {what}, got {value!r}") from None

    return WrapValidator(check)


def one_of(*choices: str) -> Any:
    """A ``Literal`` of ``choices`` reported as ``'x' is not one of a, b``."""
    def check(value: Any, handler):
        try:
            return handler(value)
        except ValidationError:
            raise problem(f"{value!r} is not one of {', '.join(choices)}") from None

    return Annotated[Literal[choices], WrapValidator(check)]


PositiveOrAuto = Annotated[Annotated[StrictInt, Field(ge=1)] | Literal["auto"], expect("an int >= 1 or 'auto'")]


Device = one_of("auto", "gpu", "cpu")


@with_config(SECTION)
@dataclass
class Resources:
    """How an evaluation runs on the cluster (the spec's ``resources:`` section; `pipelines/run/resources.py` plans
    with it)."""

    # most workers one trial uses at once; auto: as many as its blocks (and max_gpus) allow
    workers: PositiveOrAuto = AUTO
    # gpu: workers need GPUs (a sweep waits actor_wait_s for them, then exits 2); cpu: workers on CPUs; auto: gpu when
    # the cluster has GPUs or its autoscaler can add them, else cpu (said on the console) for models up to 2B
    # parameters (run/resources.py: choose_device)
    device: Device = "auto"
    # a 7B model in bf16 fits one 24+ GB GPU (device gpu)
    gpus_per_worker: Annotated[Number, Field(gt=0), expect("a number > 0")] = 1
    # image decoding and the processor are light; one core keeps 2-core laptops usable
    cpus_per_worker: Annotated[Number, Field(ge=0), expect("a number >= 0")] = 1
    # GPUs a sweep may grow to (it asks the autoscaler for them); auto: all it can use
    max_gpus: PositiveOrAuto = AUTO
    # requests per worker call (one sealed block) and per generate(); 8 fits a 7B model on a 24 GB GPU
    batch_size: Annotated[StrictInt, Field(ge=1), expect("an int >= 1")] = 8
    # a sweep that wants GPUs on a cluster with none waits this long for the first GPU node, then exits 2
    actor_wait_s: Annotated[Number, Field(gt=0), expect("a number of seconds > 0 (finite)")] = 600
    # attempts of a block whose worker dies on it (or hangs past block_timeout_s); then its samples fail
    block_attempts: Annotated[StrictInt, Field(ge=1), expect("an int >= 1")] = 3
    # one block's generation past this is a hung worker: it is restarted and the block retried; a block of 8
    # long answers (1024 tokens) of a 7B model takes about a minute on an A100
    block_timeout_s: Annotated[Number, Field(gt=0), expect("a number of seconds > 0 (finite)")] = 1800
    # a worker's model load past this is stuck (a file system or hub that does not answer, a deadlocked load): a first
    # load ends the worker and fails the sweep's trials, saying so; a reload after a restart counts as frozen time
    load_timeout_s: Annotated[Number, Field(gt=0), expect("a number of seconds > 0 (finite)")] = 1800
    # publish the weights to the object store once per sweep (see docs/pipeline.md: weight loading)
    share_weights: Annotated[bool, Field(strict=True), expect("true/false")] = True

    @property
    def actors(self) -> int | None:
        """The most workers one trial uses at once (None: ``auto``, as many as it can use)."""
        return None if self.workers == AUTO else int(self.workers)
