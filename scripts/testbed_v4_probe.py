"""Probe for testbed recipe v4: local tower tokens (+ the count as context) and supervised finding.

Stage 1 tower: each patch token predicts the kind under it, its object's region and centre (local) and the scene's
object count (context); the CLS token the kinds present and the count. Stage 2: projector alignment (as v2).
Stage 3: LM loss + an attention loss: at the last prompt position, heads 0 and 1 of LLM layer ``--layer`` put
their mass on the patches of the objects the question names (relation: head 0 the first object, head 1 the second;
count: all objects; existence "no": unsupervised).

    python scripts/testbed_v4_probe.py --vision-steps 800 --steps 3000 --report-every 500 --layer 1 \
        --batch-size 32 --save /tmp/v4/sink      # the run in testbed_v4_probe.log (26 min, one thread)

Existence "no" questions have the first real token (<s>) as their target, a sink (``--no-sink``: unsupervised).
An experiment, not the recipe: the shipped weights stay recipe v2 (docs/testbed.md, "v4 probe").
"""
from __future__ import annotations

import argparse
import logging
import random
import time

import torch

from promprune.models import PrunedVLM
from promprune.testbed import model as testbed_model
from promprune.testbed import scenes, scores, training
from promprune.training import common

log = logging.getLogger("v4")
F = torch.nn.functional
K = len(scenes.KINDS)
R = len(scenes.REGIONS)


def local_targets(scene):
    kind = torch.zeros(144, dtype=torch.long)
    region = torch.zeros(144, dtype=torch.long)
    where = torch.zeros(144, 2)
    regions = list(scenes.REGIONS)
    for obj in scene.objects:
        cells = training.object_patches(obj)
        kind[cells] = 1 + scenes.KINDS.index((obj.color, obj.shape))
        region[cells] = 1 + regions.index(obj.region)
        where[cells] = torch.tensor(obj.center) / scenes.CANVAS
    return kind, region, where


class Heads(torch.nn.Module):
    def __init__(self, width, count_context=True):
        super().__init__()
        n = scenes.MAX_OBJECTS
        self.count_context = count_context
        self.kind = torch.nn.Linear(width, 1 + K)
        self.region = torch.nn.Linear(width, 1 + R)
        self.where = torch.nn.Linear(width, 2)
        self.count = torch.nn.Sequential(torch.nn.LayerNorm(width), torch.nn.Linear(width, n))
        self.cls = torch.nn.Sequential(torch.nn.LayerNorm(width), torch.nn.Linear(width, K + n))

    def loss(self, out, batch):
        p = out.hidden_states[-2][:, 1:]
        kind, region, where = (torch.stack(t) for t in zip(*map(local_targets, batch)))
        loss = F.cross_entropy(self.kind(p).flatten(0, 1), kind.flatten())
        loss = loss + F.cross_entropy(self.region(p).flatten(0, 1), region.flatten())
        m = (kind > 0).float()
        loss = loss + 20 * ((self.where(p) - where).pow(2).sum(-1) * m).sum() / m.sum().clamp(min=1)
        count = torch.tensor([s.num_objects - 1 for s in batch])
        if self.count_context:
            loss = loss + F.cross_entropy(self.count(p).flatten(0, 1), count.repeat_interleave(144))
        present = torch.stack([training.present_kinds(s) for s in batch])
        c = self.cls(out.last_hidden_state[:, 0])
        return loss + F.binary_cross_entropy_with_logits(c[:, :K], present) + F.cross_entropy(c[:, K:], count)

    def accuracy(self, out, batch):
        p = out.hidden_states[-2][:, 1:]
        kind, region, _ = (torch.stack(t) for t in zip(*map(local_targets, batch)))
        count = torch.tensor([s.num_objects - 1 for s in batch])
        m = kind > 0
        return {"kind_obj": (self.kind(p).argmax(-1) == kind)[m].float().mean().item(),
                "region_obj": (self.region(p).argmax(-1) == region)[m].float().mean().item(),
                "count_tok": (self.count(p).argmax(-1) == count[:, None]).float().mean().item()}


def attention_targets(kwargs, drawn, image_id, sink=True):
    """[(row, head, positions)]: where head ``head`` at the last prompt position should look."""
    out = []
    for row, (scene, q) in enumerate(drawn):
        ids = kwargs["input_ids"][row]
        img = (ids == image_id).nonzero().flatten()
        if not q.refs:
            if sink:  # existence "no": the first real token (<s>) as the sink
                first = kwargs["attention_mask"][row].nonzero()[0]
                out += [(row, 0, first), (row, 1, first)]
            continue
        groups = [q.refs, q.refs] if q.family != "relation" else [q.refs[:1], q.refs[1:]]
        for head, refs in enumerate(groups):
            cells = sorted({c for i in refs for c in training.object_patches(scene.objects[i])})
            out.append((row, head, img[cells]))
    return out


def attention_loss(attn, kwargs, labels, drawn, image_id, sink=True, per_family=None):
    """attn: [B, H, T, T] of the supervised layer."""
    final = (labels != -100).float().argmax(-1) - 1
    total, n = attn.new_zeros(()), 0
    for row, head, where in attention_targets(kwargs, drawn, image_id, sink):
        mass = attn[row, head, final[row], where].sum()
        total = total - torch.log(mass + 1e-6)
        n += 1
        if per_family is not None:
            per_family.setdefault(drawn[row][1].family + ("-no" if not drawn[row][1].refs else ""), []).append(
                mass.item())
    return total / max(n, 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vision-steps", type=int, default=600)
    ap.add_argument("--align-steps", type=int, default=200)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--layer", type=int, default=1)
    ap.add_argument("--attn-weight", type=float, default=1.0)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--report-every", type=int, default=500)
    ap.add_argument("--eval-n", type=int, default=48)
    ap.add_argument("--no-count-context", action="store_true")
    ap.add_argument("--no-sink", action="store_true")
    ap.add_argument("--families", default="exist,count,attribute,relation")
    ap.add_argument("--save", default=None)
    args = ap.parse_args()
    fams = args.families.split(",")
    training.FAMILY_WEIGHTS = {f: (1.0 if f in fams else 0.0) for f in scenes.FAMILIES}
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(1)
    model, processor = testbed_model.untrained()
    model.set_attn_implementation("eager")
    vlm = PrunedVLM(model, processor, method=None)
    tower = model.model.vision_tower
    heads = Heads(model.config.vision_config.hidden_size, not args.no_count_context)
    rng = random.Random(0)
    torch.manual_seed(0)
    pixels = lambda ss: processor.image_processor([scenes.render(s) for s in ss], return_tensors="pt")["pixel_values"]  # noqa
    t0 = time.time()
    params = list(tower.parameters()) + list(heads.parameters())
    opt, sch = common.optimizer(params, args.vision_steps, args.lr)
    tower.train()
    for step in range(args.vision_steps):
        batch = [training.train_scene(step * 32 + i) for i in range(32)]
        out = tower(pixels(batch), output_hidden_states=True)
        loss = common.step(heads.loss(out, batch), params, opt, sch)
        if (step + 1) % 100 == 0:
            with torch.no_grad():
                test = [scenes.make_scene("test", 10_000 + i) for i in range(32)]
                acc = heads.accuracy(tower(pixels(test), output_hidden_states=True), test)
            log.info("vision %d loss %.3f %s (%.0fs)", step + 1, loss, acc, time.time() - t0)
    tower.eval().requires_grad_(False)
    offset = args.vision_steps * 32
    params = list(model.model.multi_modal_projector.parameters())
    opt, sch = common.optimizer(params, args.align_steps, args.lr)
    for step in range(args.align_steps):
        batch = [training.train_scene(offset + step * 32 + i) for i in range(32)]
        with torch.no_grad():
            out = tower(pixels(batch), output_hidden_states=True)
        common.step(training.align_loss(model, out, batch), params, opt, sch)
    offset += args.align_steps * 32
    log.info("align done (%.0fs)", time.time() - t0)
    params = [p for p in model.parameters() if p.requires_grad]
    opt, sch = common.optimizer(params, args.steps, args.lr)
    model.train()
    image_id = model.config.image_token_id
    for step in range(args.steps):
        drawn = [training.example(offset + step * args.batch_size + i, rng) for i in range(args.batch_size)]
        kwargs, labels = common.teacher_forcing(vlm, *training._prompts(drawn))
        out = model(**kwargs, output_attentions=True)
        lm = common.lm_loss(out.logits, labels)
        fam = {} if (step + 1) % 250 == 0 else None
        at = attention_loss(out.attentions[args.layer], kwargs, labels, drawn, image_id, not args.no_sink, fam)
        if fam:
            log.info("attn mass %s", {f: round(sum(v) / len(v), 2) for f, v in sorted(fam.items())})
        common.step(lm + args.attn_weight * at, params, opt, sch)
        if (step + 1) % 50 == 0:
            log.info("llm %d lm %.3f attn %.3f (%.0fs)", step + 1, lm.item(), at.item(), time.time() - t0)
        if (step + 1) % args.report_every == 0 or step + 1 == args.steps:
            model.eval()
            with torch.inference_mode():
                found = scores.family_scores(PrunedVLM(model, processor, method=None), args.eval_n)
                log.info("EVAL %d unpruned %s", step + 1, {f: v["score"] for f, v in found.items()})
                if step + 1 == args.steps:
                    for m in ("random", "promprune"):
                        found = scores.family_scores(PrunedVLM(model, processor, method=m, budget=16), args.eval_n)
                        log.info("EVAL %d %s@16 %s", step + 1, m, {f: v["score"] for f, v in found.items()})
            model.train()
    if args.save:
        model.eval()
        model.set_attn_implementation("sdpa")
        model.save_pretrained(args.save)


if __name__ == "__main__":
    main()
