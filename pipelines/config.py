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


@with_config(SECTION)
@dataclass
class Resources:
    """How an evaluation runs on the cluster (the spec's ``resources:`` section)."""

    # actors per evaluation; auto: spread the GPUs over the trials, 1 on CPU
    workers: PositiveOrAuto = AUTO
    # a 7B model in bf16 fits one 24+ GB GPU; ignored when the cluster has no GPU
    gpus_per_worker: Annotated[Number, Field(ge=0), expect("a number >= 0")] = 1
    # image decoding and the processor are light; one core keeps 2-core laptops usable
    cpus_per_worker: Annotated[Number, Field(ge=0), expect("a number >= 0")] = 1
    # rows per map_batches call and per generate(); 8 fits a 7B model on a 24 GB GPU
    batch_size: Annotated[StrictInt, Field(ge=1), expect("an int >= 1")] = 8
    # DataContext.wait_for_min_actors_s: an unschedulable pool fails after this long
    actor_wait_s: Annotated[Number, Field(gt=0), expect("a number of seconds > 0 (finite)")] = 600
    # publish the weights to the object store once per sweep (see docs/pipeline.md: weight loading)
    share_weights: Annotated[bool, Field(strict=True), expect("true/false")] = True

    @property
    def actors(self) -> int:
        """The actor pool's size (``auto`` outside a sweep's plan: one actor)."""
        return 1 if self.workers == AUTO else int(self.workers)
