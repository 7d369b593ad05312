"""A sample's recorded entropy says how exact it is: PromPrune's certified split (the GPU's route) reports its
bracket's midpoint and the bracket's half-width, the exact eigensolve none (``SampleStats.entropy_halfwidth``)."""
import pytest

from promprune.models import PrunedVLM
from promprune.records import Prediction, from_arrow, to_arrow
from promprune.selection import accel


@pytest.mark.parametrize("name,budget", [("tiny:llava", 8), ("tiny:llava_next", 20)])
def test_a_bracket_midpoint_carries_its_half_width_and_lies_within_it(name, budget, images, prompts):
    vlm = PrunedVLM.from_pretrained(name, method="promprune", budget=budget)
    with accel.entropy("exact"):  # the reference: the eigensolve on every view
        exact = vlm.prepare(images, prompts).stats
    with accel.entropy("certified"):  # the bounds, as "auto" takes them on a GPU
        bounded = vlm.prepare(images, prompts).stats
        generated = vlm.generate(images, prompts, max_new_tokens=1)
    widths = []
    for e, b, g in zip(exact, bounded, generated):
        assert e["entropy_halfwidth"] is None  # exact
        assert b["kept"] == e["kept"] and b["saliency_count"] == e["saliency_count"]  # the same decisions
        assert b["entropy_halfwidth"] is not None and b["entropy_halfwidth"] >= 0
        assert abs(b["entropy"] - e["entropy"]) <= b["entropy_halfwidth"] + 1e-6
        assert g.entropy_halfwidth == pytest.approx(b["entropy_halfwidth"])  # through generate's records
        widths.append(b["entropy_halfwidth"])
    assert max(widths) > 0  # some view decided by its bracket, not the eigensolve


def test_the_half_width_travels_in_the_prediction_records():
    sent = [Prediction(task="t", doc_id=i, n_docs=2, prompt="p", entropy=0.5, entropy_halfwidth=width)
            for i, width in enumerate((3e-4, None))]
    back = from_arrow(to_arrow(sent, Prediction), Prediction)
    assert [p.entropy_halfwidth for p in back] == [pytest.approx(3e-4), None]
