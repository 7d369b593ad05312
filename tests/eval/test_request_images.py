"""Each distinct image is encoded once and stored once per block; every request still gets its own image back."""
from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from promprune.eval.generation import image_to_png
from promprune.eval.requests import build_requests, image_key, pack_requests, share_images
from promprune.records import Request


def _png(seed: int) -> tuple[bytes, str]:
    pixels = np.random.default_rng(seed).integers(0, 256, (6, 5, 3), dtype=np.uint8)
    image = Image.fromarray(pixels)
    return image_to_png(image), image_key(image)


def _request(task: str, doc_id: int, seed: int | None) -> Request:
    png, key = _png(seed) if seed is not None else (_png(99)[0], None)
    return Request(task=task, doc_id=doc_id, n_docs=10, prompt=f"q{doc_id}", image=png, image_key=key)


def test_image_key_follows_pixels_not_files():
    pixels = np.random.default_rng(0).integers(0, 256, (4, 4, 3), dtype=np.uint8)
    a, b = Image.fromarray(pixels), Image.fromarray(pixels.copy())
    assert image_key(a) == image_key(b)  # equal pictures, different objects
    other = pixels.copy()
    other[0, 0, 0] ^= 1
    assert image_key(Image.fromarray(other)) != image_key(a)
    # same bytes, another shape: a different picture
    assert image_key(Image.fromarray(pixels.reshape(2, 8, 3))) != image_key(a)


def test_pack_stores_each_image_once_and_keeps_groups_whole():
    # seeds: image A asked 3 times (two tasks), B twice, C once, one request without a key
    rows = [_request("t1", 0, 1), _request("t1", 1, 2), _request("t2", 2, 1), _request("t1", 3, 3),
            _request("t1", 4, 1), _request("t1", 5, 2), _request("t1", 6, None)]
    blocks = pack_requests(rows, batch_size=3)
    # groups in first-appearance order: A (3 rows) | B (2) + C (1) | no-key (1); a group never spans blocks
    assert [[r.doc_id for r in b] for b in blocks] == [[0, 2, 4], [1, 5, 3], [6]]
    for block in blocks:
        carried = [r.image_key for r in block if r.image is not None and r.image_key]
        assert len(carried) == len(set(carried))  # one stored copy per image and block
    assert sum(r.image is not None for b in blocks for r in b) == 4  # A, B, C and the keyless one
    restored = {r.key: r for b in blocks for r in share_images(b)}
    assert restored == {r.key: r for r in rows}


def test_a_group_larger_than_a_batch_is_one_block():
    rows = [_request("gqa", i, 7) for i in range(5)] + [_request("gqa", 5, 8)]
    blocks = pack_requests(rows, batch_size=2)
    assert [len(b) for b in blocks] == [5, 1]


def test_an_image_missing_from_its_block_is_a_named_failed_sample():
    png, key = _png(1)
    orphan = Request(task="t", doc_id=3, n_docs=4, prompt="q", image=None, image_key=key)
    (row,) = share_images([orphan])
    assert row.error and "doc 3" in row.error and key in row.error


def test_pack_rejects_a_bad_batch_size():
    with pytest.raises(ValueError, match="batch_size"):
        pack_requests([], 0)


def test_build_requests_encodes_each_image_once():
    """easy-vqa asks several questions about each image, in both tasks: they share one key and one PNG object."""
    rows = build_requests(["easyvqa_yesno", "easyvqa_open"], limit=60)
    by_key: dict[str, list[Request]] = {}
    for r in rows:
        by_key.setdefault(r.image_key, []).append(r)
    assert len(by_key) < len(rows)  # the benchmark repeats images
    for group in by_key.values():
        assert all(r.image is group[0].image for r in group)  # the same bytes object: encoded once
    assert len({id(r.image) for r in rows}) == len(by_key)
    # and the stored form round-trips: pack, drop nothing, restore every image
    blocks = pack_requests(rows, batch_size=8)
    stored = sum(r.image is not None for b in blocks for r in b)
    assert stored == len(by_key)
    assert {r.key: r for b in blocks for r in share_images(b)} == {r.key: r for r in rows}


def test_an_odd_mme_limit_is_refused_before_anything_loads(hub_standins):
    """MME scores question pairs: an odd limit would generate everything, then fail in scoring (issue 21)."""
    from pipelines.preflight import check_tasks
    from promprune.eval.standins import serving

    with pytest.raises(ValueError, match="pairs"):
        build_requests(["mme"], limit=5)
    with serving(hub_standins):  # their data is here (the checks also look for it)
        (error,) = check_tasks(["mme", "pope"], 5)
        assert error.startswith("limit:") and "'mme'" in error and "6" in error
        assert check_tasks(["mme"], 6) == [] and check_tasks(["pope"], 5) == []


def test_a_prediction_keeps_its_requests_image_key():
    """The report groups one image's questions by the key its predictions carry (not the image's bytes)."""
    from promprune.records import Answer, Prediction, arrow_schema, to_arrow

    asked = _request("t1", 0, 1)
    got = Prediction.answering(asked, Answer(prediction="yes", entropy=0.5))
    assert got.image_key == _png(1)[1] and len(got.image_key) == 32
    table = to_arrow([got, Prediction.answering(_request("t1", 1, None), Answer(prediction="no"))], Prediction)
    assert table.column("image_key").to_pylist() == [_png(1)[1], None]
    assert "image" not in arrow_schema(Prediction).names and "video" not in arrow_schema(Prediction).names
