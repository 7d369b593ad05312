"""An offline short-video multiple-choice task: which way does an object of a procedural clip move?

``testbed_video_direction`` (``promprune.eval.tasks.VIDEO_TASKS``) stands in for MVBench's ``moving_direction`` (which
asks the same of CLEVRER clips) where no video can be downloaded: each document is a testbed scene of 1-4 objects
moving ``STEP`` px per frame at most (:mod:`promprune.testbed.clips`), written as an mp4 file of ``FRAMES`` frames,
and the question "which direction does the <colour> <shape> move?" with the four directions as options (in a
per-document order). The asked object moves mostly along one axis (|vx| != |vy|), and a scene is used only when
every object stays whole inside the frame and clear of every other object (at least one free pixel between their
boxes) in every frame (:func:`stays_clear`), so the answer is unambiguous: nothing leaves the canvas or hides another.
Documents are MVBench-shaped (``question``, ``candidates``, ``answer`` = the right candidate's text, ``video`` = the
file's path), so MVBench's own prompt and scoring (lmms-eval's ``mvbench`` utils) apply unchanged.
"""
from __future__ import annotations

import random
from pathlib import Path

from . import scenes
from .clips import moving_scene, velocities

DOCS = 24  # clips (one question each): small, the task is a plumbing check and a CPU-sized sanity run
FRAMES, FPS, STEP = 8, 4, 3
DIRECTIONS = ("left", "right", "up", "down")
_OFFSET = 300_000  # its own block of the test seed stream


def direction(vx: int, vy: int) -> str | None:
    """The dominant direction of a velocity (image y grows downwards), or None when no axis dominates."""
    if abs(vx) == abs(vy):
        return None
    if abs(vx) > abs(vy):
        return "right" if vx > 0 else "left"
    return "down" if vy > 0 else "up"


def write_mp4(frames, path: Path, fps: int = FPS) -> None:
    """RGB PIL frames -> an mp4 file (MPEG-4 part 2, yuv420p) with PyAV."""
    import av

    with av.open(str(path), "w") as out:
        stream = out.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = frames[0].size[0], frames[0].size[1], "yuv420p"
        for image in frames:
            out.mux(stream.encode(av.VideoFrame.from_image(image)))
        out.mux(stream.encode())


def boxes(obj: scenes.Obj, velocity: tuple[int, int], frames: int = FRAMES) -> list[tuple[float, ...]]:
    """The object's bounding box ``(x0, y0, x1, y1)`` (px, as :func:`scenes.render` draws it, both ends inclusive) in
    each frame of its clip."""
    (cx, cy), h = obj.center, scenes.extent(obj) / 2
    return [(cx + t * velocity[0] - h, cy + t * velocity[1] - h, cx + t * velocity[0] + h, cy + t * velocity[1] + h)
            for t in range(frames)]


def stays_clear(scene: scenes.Scene, moves: list[tuple[int, int]], frames: int = FRAMES) -> bool:
    """Whether, in every frame, every object lies whole inside the canvas and at least one free pixel away from every
    other object along some axis (so none is cut off, overlaps or touches another)."""
    tracks = [boxes(o, v, frames) for o, v in zip(scene.objects, moves)]
    for t in range(frames):
        now = [track[t] for track in tracks]
        if any(x0 < 0 or y0 < 0 or x1 > scenes.CANVAS - 1 or y1 > scenes.CANVAS - 1 for x0, y0, x1, y1 in now):
            return False
        for i, a in enumerate(now):
            for b in now[i + 1:]:
                if not (a[0] - b[2] >= 2 or b[0] - a[2] >= 2 or a[1] - b[3] >= 2 or b[1] - a[3] >= 2):
                    return False
    return True


def documents(n: int = DOCS):
    """``n`` (scene, asked object, its direction, option order) tuples, deterministic: the test scenes from
    ``_OFFSET`` on whose clip :func:`stays_clear`, document ``i`` asking about an object that moves mostly
    ``DIRECTIONS[i % 4]`` (so each direction is the answer equally often: the filter alone would favour some)."""
    out, index = [], _OFFSET
    while len(out) < n:
        scene = scenes.make_scene("test", index, num_objects=1 + index % 4)
        rng = random.Random(scene.seed ^ 0xD1)
        moves = velocities(scene, STEP)
        want = DIRECTIONS[len(out) % len(DIRECTIONS)]
        moving = [o for o, v in zip(scene.objects, moves) if direction(*v) == want]
        index += 1
        if moving and stays_clear(scene, moves):
            obj = rng.choice(moving)
            options = list(DIRECTIONS)
            rng.shuffle(options)
            out.append((scene, obj, want, options))
    return out


def tables(root: Path, n: int = DOCS) -> dict[str, dict]:
    """{task name: columns}; the clips are written as mp4 files under ``root / "clips"``."""
    clips = Path(root) / "clips"
    clips.mkdir(parents=True, exist_ok=True)
    columns: dict[str, list] = {"question_id": [], "question": [], "candidates": [], "answer": [], "video": [],
                                "num_objects": []}
    for i, (scene, obj, answer, options) in enumerate(documents(n)):
        path = clips / f"direction_{i:03d}.mp4"
        write_mp4(moving_scene(scene, frames=FRAMES, step=STEP), path)
        columns["question_id"].append(i)
        columns["question"].append(f"Which direction does the {obj.color} {obj.shape} move?")
        columns["candidates"].append("|".join(options))  # parquet columns are scalars: the utils split it
        columns["answer"].append(answer)
        columns["video"].append(str(path))
        columns["num_objects"].append(scene.num_objects)
    return {"testbed_video_direction": columns}
