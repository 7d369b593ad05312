"""Where a testbed model's relation answers come from (issue 27: recipe v5 answered them at chance; stage 4 of
recipe v6 is the fix). A diagnostic on trained weights, not part of the recipe:

    python scripts/testbed_relation_probe.py --weights promprune/testbed/weights

On relation questions: what the model answers; how much of each find head's attention lands on the object it should
(head 0: the first object named, head 1: the second); and linear read-outs, at the answer-predicting position
entering each LLM layer, of the facts the answer rests on (:func:`training.relation_facts`: is the first object left
of the second, above it, which relation is asked), fitted on 512 train questions and scored on 256 test ones.
"""
from __future__ import annotations

import argparse
import logging
import random
from pathlib import Path

import torch

from promprune.models import PrunedVLM
from promprune.testbed import model as testbed_model
from promprune.testbed import scenes, scores, shipped, training
from promprune.training import common

log = logging.getLogger("relation")
F = torch.nn.functional


def relation_questions(split: str, start: int, n: int, rng: random.Random) -> list:
    out, index = [], start
    while len(out) < n:
        scene = scenes.make_scene(split, index)
        index += 1
        found = scenes.questions(scene, "relation")
        if found:
            out.append((scene, rng.choice(found)))
    return out


def forward(model, vlm, drawn):
    kwargs, labels = common.teacher_forcing(vlm, *training._prompts(drawn))
    out = model(**kwargs, output_attentions=True, output_hidden_states=True)
    return kwargs, labels, out


@torch.no_grad()
def diagnose(model, vlm, n_train: int = 512, n_test: int = 256) -> None:
    model.eval()
    rng = random.Random(1)
    sets = {"train": relation_questions("train", 50_000_000, n_train, rng),
            "test": relation_questions("test", 30_000, n_test, rng)}
    feats, targets, masses = {}, {}, []
    for name, drawn in sets.items():
        hs, ts = [], []
        for i in range(0, len(drawn), 32):
            chunk = drawn[i:i + 32]
            kwargs, labels, out = forward(model, vlm, chunk)
            pos = training.answer_positions(labels)
            rows = torch.arange(len(chunk))
            hs.append(torch.stack([h[rows, pos] for h in out.hidden_states], 1))  # [b, layers + 1, width]
            ts += [training.relation_facts(s, q) for s, q in chunk]
            if name == "test":
                for role, row, head, p, keys in training.attention_targets(
                        kwargs["input_ids"], kwargs["attention_mask"], labels, chunk, model.config.image_token_id):
                    if role == "find":
                        masses.append((head, float(out.attentions[training.FIND_LAYER][row, head, p, keys].sum())))
        feats[name], targets[name] = torch.cat(hs), torch.tensor(ts)
    for head in training.FIND_HEADS:
        values = [m for h, m in masses if h == head]
        log.info("find head %d: mean mass on its object %.3f (test relation questions)", head,
                 sum(values) / len(values))
    said = scores.answers(vlm, sets["test"][:96])
    log.info("answers on 96 test relation questions: %s, accuracy %.3f",
             {a: said.count(a) for a in sorted(set(said))},
             sum(a == q.answer for a, (_, q) in zip(said, sets["test"])) / len(said))
    names = ("A left of B", "A above B", "relation word")
    for layer in range(feats["train"].shape[1]):
        found = {}
        for k, name in enumerate(names):
            classes = int(targets["train"][:, k].max()) + 1
            probe = torch.nn.Linear(feats["train"].shape[-1], classes)
            opt = torch.optim.Adam(probe.parameters(), lr=1e-2)
            x, y = feats["train"][:, layer], targets["train"][:, k]
            mean, std = x.mean(0), x.std(0) + 1e-6
            with torch.enable_grad():
                for _ in range(300):
                    opt.zero_grad()
                    F.cross_entropy(probe((x - mean) / std), y).backward()
                    opt.step()
            pred = probe((feats["test"][:, layer] - mean) / std).argmax(-1)
            found[name] = round(float((pred == targets["test"][:, k]).float().mean()), 3)
        log.info("linear read-out entering layer %d (%s): %s", layer, "embeddings" if layer == 0 else "residual", found)
    model.train()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--weights", type=Path, default=shipped.WEIGHTS_DIR)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    from transformers import LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(args.weights, dtype=torch.float32)  # any recipe's weights
    model.set_attn_implementation("eager")
    vlm = PrunedVLM(model, testbed_model.untrained()[1], method=None)
    diagnose(model, vlm)


if __name__ == "__main__":
    main()
