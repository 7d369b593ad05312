"""promprune.testbed.scores scores each family as its lmms-eval task does (the task's prompt, max_new_tokens and
normalization), not by exact match of the raw text: a pruned model that says "Yes yes" said yes."""
import re
from pathlib import Path

from promprune.models.vlm import Generation
from promprune.testbed import scores

TASKS = Path(scores.__file__).parents[1] / "eval" / "lmms_tasks" / "testbed"
SAYS = {"exist": "Yes yes", "relation": "Yes yes", "count": "7.", "attribute": "Red."}


class Sayer:
    """A model that says one thing per kind of question (told by the task's post-prompt; existence and relation
    both "Yes yes"), recording what it was asked."""

    model = None
    BY_PROMPT = {"yes or no": "Yes yes", "a number": "7.", "one word": "Red."}

    def __init__(self):
        self.asked = []

    def generate(self, images, prompts, **kwargs):
        self.asked += [(p, kwargs["max_new_tokens"]) for p in prompts]
        return [Generation(text=next(text for key, text in self.BY_PROMPT.items() if key in p)) for p in prompts]


def test_family_scores_read_answers_as_the_tasks_do():
    n = 24
    said = Sayer()
    found = scores.family_scores(said, n)
    gold = {family: [q.answer for _, q in scores.family_questions(family, n)] for family in SAYS}
    yes, no = gold["exist"].count("yes"), gold["exist"].count("no")
    assert yes and no
    # always "yes": precision yes / n, recall 1, F1 2 yes / (2 yes + no); the old exact match read "yes yes" as no
    assert found["exist"] == {"score": round(2 * yes / (2 * yes + no), 4), "metric": "f1", "chance": 0.5, "n": n}
    assert found["relation"]["score"] == round(gold["relation"].count("yes") / n, 4) > 0
    assert found["relation"]["metric"] == "accuracy"
    assert found["count"]["score"] == round(gold["count"].count("7") / n, 4)
    assert found["attribute"]["score"] == round(gold["attribute"].count("red") / n, 4) > 0
    assert found["count"]["metric"] == found["attribute"]["metric"] == "exact_match"
    # generated as the tasks' YAML asks (the old scorer: 3 new tokens)
    common = re.search(r"max_new_tokens: (\d+)", (TASKS / "_testbed_common_yaml").read_text())
    assert {tokens for _, tokens in said.asked} == {int(common.group(1))} == {4}
    assert len(said.asked) == 4 * n


def test_answers_use_the_tasks_max_new_tokens_and_prompt():
    said = Sayer()
    drawn = [d for family in SAYS for d in scores.family_questions(family, 2)]
    assert scores.answers(said, drawn) == [SAYS[q.family].lower() for _, q in drawn]
    assert [p for p, _ in said.asked] == [q.question + ("\nAnswer with a number." if q.family == "count" else
                                                        "\nAnswer with one word." if q.family == "attribute" else
                                                        "\nAnswer with yes or no.") for _, q in drawn]
    assert {tokens for _, tokens in said.asked} == {4}
