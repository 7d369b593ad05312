"""The yes/no metrics of the offline tasks (POPE's protocol) against counts worked by hand."""
import pytest

from promprune.eval import offline_metrics as m


def records(pairs):
    return [{"prediction": p, "answer": a} for p, a in pairs]


# 3 true positives, 1 false positive, 2 misses of a yes (one a 'no', one another answer), 2 true negatives, 1 other
# answer to a no-question (neither a false positive nor a true negative)
CASE = records([("yes", "yes")] * 3 + [("yes", "no"), ("no", "yes"), ("other", "yes")] + [("no", "no")] * 2
               + [("other", "no")])


def test_precision_recall_f1_accuracy_and_yes_ratio_by_hand():
    assert m.yesno_precision(CASE) == pytest.approx(3 / 4)
    assert m.yesno_recall(CASE) == pytest.approx(3 / 5)
    assert m.yesno_f1(CASE) == pytest.approx(2 * (3 / 4) * (3 / 5) / (3 / 4 + 3 / 5))
    assert m.yesno_accuracy(CASE) == pytest.approx(5 / 9)
    assert m.yesno_yes_ratio(CASE) == pytest.approx(4 / 9)


def test_no_yes_at_all_scores_zero_rather_than_dividing_by_zero():
    nothing = records([("no", "no"), ("other", "no")])
    assert (m.yesno_precision(nothing), m.yesno_recall(nothing), m.yesno_f1(nothing)) == (0.0, 0.0, 0.0)


def test_the_offline_tasks_scale_a_16_bit_image_instead_of_clipping_it():
    """PIL's convert("RGB") clips a 16-bit grey image ("I;16" / "I") at 255: a photo came out all white. The offline
    tasks' doc_to_visual scales it over its 16-bit range, as every image PrunedVLM is given is."""
    import numpy as np
    from PIL import Image

    from promprune.eval.offline_metrics import doc_to_visual

    grey = np.arange(0, 65536, 257, dtype=np.uint16).reshape(16, 16)  # 0, 257, ..., 65535: 8-bit 0..255 times 257
    (rgb,) = doc_to_visual({"image": Image.fromarray(grey)})
    assert rgb.mode == "RGB" and np.array_equal(np.asarray(rgb)[..., 0], np.arange(256).reshape(16, 16))
    assert (np.asarray(Image.fromarray(grey).convert("RGB")) == 255).mean() > 0.99  # what the tasks did before
