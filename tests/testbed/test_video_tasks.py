"""testbed_video_direction's documents, read off the rendered frames: every object stays whole inside the canvas and
clear of the others in every frame, and the asked object's pixels move the answered way."""
import dataclasses

import numpy as np

from promprune.testbed import clips, scenes, video_tasks


def _mask(scene, obj) -> np.ndarray:
    """The pixels ``obj`` covers, drawn alone on a plain canvas."""
    alone = np.asarray(scenes.render(dataclasses.replace(scene, objects=(obj,), background="plain")))
    empty = np.asarray(scenes.render(dataclasses.replace(scene, objects=(), background="plain")))
    return (alone != empty).any(axis=2)


def _grown(mask: np.ndarray) -> np.ndarray:
    """``mask`` and its 8 neighbours: two objects whose grown masks do not meet have a free pixel between them."""
    padded = np.pad(mask, 1)
    n = mask.shape[0]
    return np.logical_or.reduce([padded[1 + dy:1 + dy + n, 1 + dx:1 + dx + n]
                                 for dy in (-1, 0, 1) for dx in (-1, 0, 1)])


def test_every_object_stays_whole_and_apart_and_the_answer_is_what_the_pixels_show():
    docs = video_tasks.documents()
    assert len(docs) == video_tasks.DOCS
    assert sorted(answer for *_, answer, _ in docs) == sorted(video_tasks.DIRECTIONS * (video_tasks.DOCS // 4))
    for scene, asked, answer, options in docs:
        frames = [np.asarray(f) for f in clips.moving_scene(scene, frames=video_tasks.FRAMES, step=video_tasks.STEP)]
        moves = clips.velocities(scene, video_tasks.STEP)
        centroids = []
        for t, frame in enumerate(frames):
            moved = [dataclasses.replace(o, dx=o.dx + t * vx, dy=o.dy + t * vy)
                     for o, (vx, vy) in zip(scene.objects, moves)]
            masks = [_mask(scene, o) for o in moved]
            for obj, mask in zip(moved, masks):
                # whole: as many pixels as the same object drawn in the middle of the canvas
                middle = dataclasses.replace(obj, row=2, col=2, dx=0, dy=0)
                assert mask.sum() == _mask(scene, middle).sum(), (scene.index, t, obj)
                # nothing drawn over it in the frame the clip shows
                assert (frame[mask] == scenes.COLORS[obj.color]).all(), (scene.index, t, obj)
            for i in range(len(masks)):
                for j in range(i + 1, len(masks)):
                    assert not (_grown(masks[i]) & masks[j]).any(), (scene.index, t, moved[i], moved[j])
            ys, xs = np.nonzero(masks[scene.objects.index(asked)])
            centroids.append((xs.mean(), ys.mean()))
        dx, dy = np.subtract(centroids[-1], centroids[0])
        assert video_tasks.direction(round(dx), round(dy)) == answer, (scene.index, dx, dy, answer)
        assert sorted(options) == sorted(video_tasks.DIRECTIONS)
