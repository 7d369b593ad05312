"""Procedural clips: a testbed scene whose objects move a few pixels per frame (the offline stand-in for a video).

Every object of :func:`promprune.testbed.scenes.make_scene` gets a constant velocity of ``-step..step`` px per frame
along each axis, drawn from the scene's seed (at least one object moves whenever ``step > 0``); frame ``t`` renders
the scene with each object shifted by ``t`` times its velocity, on the scene's own (fixed) background. Deterministic
from ``(split, index, frames, step)``.
"""
from __future__ import annotations

import dataclasses
import random

from PIL import Image

from .scenes import Scene, make_scene, render


def velocities(scene: Scene, step: int) -> list[tuple[int, int]]:
    """``(vx, vy)`` px per frame of each object, in ``-step..step``; not all zero when ``step > 0``."""
    rng = random.Random(scene.seed ^ 0xC11B)
    out = [(rng.randint(-step, step), rng.randint(-step, step)) for _ in scene.objects]
    if step > 0 and all(v == (0, 0) for v in out):
        out[0] = (step, 0)
    return out


def moving_scene(scene: Scene, frames: int = 6, step: int = 2) -> list[Image.Image]:
    """``frames`` RGB frames (96x96) of ``scene`` with its objects moving ``step`` px per frame at most."""
    if frames < 1:
        raise ValueError(f"frames must be >= 1, got {frames}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    moves = velocities(scene, step)
    clip = []
    for t in range(frames):
        moved = tuple(dataclasses.replace(o, dx=o.dx + t * vx, dy=o.dy + t * vy) for o, (vx, vy) in zip(scene.objects,
                                                                                                        moves))
        clip.append(render(dataclasses.replace(scene, objects=moved)))
    return clip


def scene_clip(split: str = "test", index: int = 0, frames: int = 6, step: int = 2,
               **scene_kwargs) -> list[Image.Image]:
    """The clip of scene ``index`` of ``split`` (``scene_kwargs``: :func:`make_scene`'s ``num_objects`` /
    ``background``)."""
    return moving_scene(make_scene(split, index, **scene_kwargs), frames=frames, step=step)
