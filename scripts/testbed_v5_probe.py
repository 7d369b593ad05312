"""Probe for testbed recipe v5 (issue 27): a tower whose tokens carry their own object, and supervised finding.

Two stages, run separately so one tower serves several LLM experiments:

    python scripts/testbed_v5_probe.py tower --steps 4000 --save /tmp/v5/tower64.pt
    python scripts/testbed_v5_probe.py llm --tower /tmp/v5/tower64.pt --steps 3000

An experiment, not the recipe: what worked here (the tower stage and the LLM stage with --gather --probe
--sink-after) is recipe v5 in promprune/testbed/training.py. The multi-turn (--turns) and curriculum (--curriculum)
options the L2 run used went with v2's code; they are in this file's git history.
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

log = logging.getLogger("v5")
F = torch.nn.functional
K = len(scenes.KINDS)
R = len(scenes.REGIONS)
COLORS, SHAPES, REGIONS = list(scenes.COLORS), list(scenes.SHAPES), list(scenes.REGIONS)


def local_targets(scene):
    """Per patch: kind, colour, shape, region (1-based, 0 = background) and the object's centre."""
    kind, color, shape, region = (torch.zeros(144, dtype=torch.long) for _ in range(4))
    where = torch.zeros(144, 2)
    for obj in scene.objects:
        cells = training.object_patches(obj)
        kind[cells] = 1 + scenes.KINDS.index((obj.color, obj.shape))
        color[cells] = 1 + COLORS.index(obj.color)
        shape[cells] = 1 + SHAPES.index(obj.shape)
        region[cells] = 1 + REGIONS.index(obj.region)
        where[cells] = torch.tensor(obj.center) / scenes.CANVAS
    return kind, color, shape, region, where


class Heads(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        n = scenes.MAX_OBJECTS
        self.kind = torch.nn.Linear(width, 1 + K)
        self.color = torch.nn.Linear(width, 1 + len(COLORS))
        self.shape = torch.nn.Linear(width, 1 + len(SHAPES))
        self.region = torch.nn.Linear(width, 1 + R)
        self.where = torch.nn.Linear(width, 2)
        self.count = torch.nn.Sequential(torch.nn.LayerNorm(width), torch.nn.Linear(width, n))
        self.cls = torch.nn.Sequential(torch.nn.LayerNorm(width), torch.nn.Linear(width, K + n))

    def loss(self, out, batch):
        p = out.hidden_states[-2][:, 1:]
        kind, color, shape, region, where = (torch.stack(t) for t in zip(*map(local_targets, batch)))
        loss = F.cross_entropy(self.kind(p).flatten(0, 1), kind.flatten())
        loss = loss + F.cross_entropy(self.color(p).flatten(0, 1), color.flatten())
        loss = loss + F.cross_entropy(self.shape(p).flatten(0, 1), shape.flatten())
        loss = loss + F.cross_entropy(self.region(p).flatten(0, 1), region.flatten())
        m = (kind > 0).float()
        loss = loss + 20 * ((self.where(p) - where).pow(2).sum(-1) * m).sum() / m.sum().clamp(min=1)
        count = torch.tensor([s.num_objects - 1 for s in batch])
        loss = loss + F.cross_entropy(self.count(p).flatten(0, 1), count.repeat_interleave(144))
        present = torch.stack([training.present_kinds(s) for s in batch])
        c = self.cls(out.last_hidden_state[:, 0])
        return loss + F.binary_cross_entropy_with_logits(c[:, :K], present) + F.cross_entropy(c[:, K:], count)

    @torch.no_grad()
    def accuracy(self, out, batch):
        p = out.hidden_states[-2][:, 1:]
        kind, color, shape, region, _ = (torch.stack(t) for t in zip(*map(local_targets, batch)))
        count = torch.tensor([s.num_objects - 1 for s in batch])
        m = kind > 0
        acc = lambda head, t: round((head(p).argmax(-1) == t)[m].float().mean().item(), 3)  # noqa: E731
        bg = round((self.kind(p).argmax(-1) == 0)[~m].float().mean().item(), 3)
        return {"kind": acc(self.kind, kind), "color": acc(self.color, color), "shape": acc(self.shape, shape),
                "region": acc(self.region, region), "bg": bg,
                "count_tok": round((self.count(p).argmax(-1) == count[:, None]).float().mean().item(), 3)}


def pixels(processor, batch):
    return processor.image_processor([scenes.render(s) for s in batch], return_tensors="pt")["pixel_values"]


def make_model(width, layers=4, text_width=96, text_layers=4, text_heads=4, kv_heads=2, rope_theta=None):
    tok = testbed_model.tokenizer()
    cfg = testbed_model.config(tok)
    v = cfg.vision_config
    v.hidden_size, v.intermediate_size, v.num_hidden_layers = width, 4 * width, layers
    v.num_attention_heads = max(width // 16, 4)
    t = cfg.text_config
    t.hidden_size, t.intermediate_size, t.num_hidden_layers = text_width, 2 * text_width, text_layers
    t.num_attention_heads, t.num_key_value_heads, t.head_dim = text_heads, kv_heads, text_width // text_heads
    if rope_theta is not None:
        t.rope_parameters = {**t.rope_parameters, "rope_theta": rope_theta}
    torch.manual_seed(0)
    from transformers import LlavaForConditionalGeneration
    return LlavaForConditionalGeneration(cfg), testbed_model.processor(tok)


def tower_stage(args):
    model, processor = make_model(args.width, args.layers, args.text_width, args.text_layers)
    tower = model.model.vision_tower
    heads = Heads(args.width)
    params = list(tower.parameters()) + list(heads.parameters())
    opt, sch = common.optimizer(params, args.steps, args.lr)
    tower.train()
    t0 = time.time()
    test = [scenes.make_scene("test", 10_000 + i) for i in range(64)]
    for step in range(args.steps):
        batch = [training.train_scene(step * args.batch_size + i) for i in range(args.batch_size)]
        loss = common.step(heads.loss(tower(pixels(processor, batch), output_hidden_states=True), batch),
                           params, opt, sch)
        if (step + 1) % args.report_every == 0 or step + 1 == args.steps:
            tower.eval()
            acc = heads.accuracy(tower(pixels(processor, test), output_hidden_states=True), test)
            tower.train()
            log.info("tower %d loss %.3f %s (%.0fs)", step + 1, loss, acc, time.time() - t0)
    torch.save({"tower": tower.state_dict(), "args": vars(args)}, args.save)


WORD_IDS = None


def word_ids():
    global WORD_IDS
    if WORD_IDS is None:
        tok = testbed_model.tokenizer()
        WORD_IDS = {w: tok.convert_tokens_to_ids(w) for w in tok.get_vocab()}
    return WORD_IDS


def answer_positions(labels):
    """[(row, position)] of every position whose next token starts an answer (labels shifted by one)."""
    lab = labels != -100
    start = lab[:, 1:] & ~lab[:, :-1]  # position p predicts p+1, the first labelled token of a run
    return [tuple(rc) for rc in start.nonzero().tolist()]


def question_words(q):
    """The words of ``q`` each head of the gather layer should read: (first group, second group)."""
    if q.family == "attribute":
        region = q.question.split(" at the ")[1].rstrip("?").split()
        return region, region
    if q.family == "count":
        return [], []
    words = q.question.lower().rstrip("?").split()
    kinds = [(words[i], words[i + 1]) for i in range(len(words) - 1) if words[i] in COLORS and words[i + 1] in SHAPES]
    first = list(kinds[0])
    return first, list(kinds[-1])


def attention_targets(kwargs, labels, drawn, image_id, sink=True):
    """{(layer role, row, head, position): target key positions}. Roles: "find" (heads 0, 1: the objects the
    question names; existence "no": the first real token, a sink), "gather" (heads 2, 3: the question's words)."""
    ids_all = kwargs["input_ids"]
    out = []
    per_row: dict[int, list[int]] = {}
    for row, pos in answer_positions(labels):
        per_row.setdefault(row, []).append(pos)
    wid = word_ids()
    for row, (scene, asked) in enumerate(drawn):
        asked = asked if isinstance(asked, list) else [asked]
        ids = ids_all[row]
        img = (ids == image_id).nonzero().flatten()
        first_real = kwargs["attention_mask"][row].nonzero()[0]
        start = int(img[-1]) + 1
        for q, pos in zip(asked, sorted(per_row[row])):
            groups = [q.refs, q.refs] if q.family != "relation" else [q.refs[:1], q.refs[1:]]
            for head, refs in enumerate(groups):
                if refs:
                    cells = sorted({c for i in refs for c in training.object_patches(scene.objects[i])})
                    out.append(("find", row, head, pos, img[cells], q.family))
                elif sink:
                    out.append(("find", row, head, pos, first_real, "exist-no"))
            span = ids[start:pos + 1]
            for head, words in zip((2, 3), question_words(q)):
                hits = [start + int(i) for w in words for i in (span == wid[w]).nonzero().flatten()[:1]]
                if q.family == "relation" and head == 3:  # the second kind: its last occurrence
                    hits = [start + int((span == wid[w]).nonzero().flatten()[-1]) for w in words]
                if hits:
                    out.append(("gather", row, head, pos, torch.tensor(hits), q.family))
            start = pos + 1
    return out


def attention_loss(attentions, targets, layers, family_of=None, log_mass=None):
    total, n = attentions[0].new_zeros(()), 0
    for role, row, head, pos, where, family in targets:
        if role not in layers:
            continue
        mass = attentions[layers[role]][row, head, pos, where].sum()
        total = total - torch.log(mass + 1e-6)
        n += 1
        if log_mass is not None:
            log_mass.setdefault(role if role == "gather" else family, []).append(mass.item())
    return total / max(n, 1)


class Probe(torch.nn.Module):
    """Linear read-outs of what the question asks for, from the residual entering the find layer at each answer
    position: colour and shape of the first and of the second kind named, and the region (0 = none)."""

    def __init__(self, width):
        super().__init__()
        sizes = [len(COLORS), len(SHAPES), len(COLORS), len(SHAPES), R]
        self.heads = torch.nn.ModuleList([torch.nn.Linear(width, 1 + n) for n in sizes])

    @staticmethod
    def targets(q):
        first, second = question_words(q) if q.family in ("exist", "relation") else ([], [])
        region = q.question.split(" at the ")[1].rstrip("?") if q.family == "attribute" else None
        out = []
        for words in (first, second):
            out += [1 + COLORS.index(words[0]) if words else 0, 1 + SHAPES.index(words[1]) if words else 0]
        return out + [1 + REGIONS.index(region) if region else 0]

    def loss(self, hidden, labels, drawn):
        rows, positions, targets = [], [], []
        per_row: dict[int, list[int]] = {}
        for row, pos in answer_positions(labels):
            per_row.setdefault(row, []).append(pos)
        for row, (_, asked) in enumerate(drawn):
            asked = asked if isinstance(asked, list) else [asked]
            for q, pos in zip(asked, sorted(per_row[row])):
                rows.append(row)
                positions.append(pos)
                targets.append(self.targets(q))
        h = hidden[rows, positions]
        t = torch.tensor(targets)
        return sum(F.cross_entropy(head(h), t[:, i]) for i, head in enumerate(self.heads))


def evaluate(model, processor, n, step, final):
    model.eval()
    with torch.inference_mode():
        found = scores.family_scores(PrunedVLM(model, processor, method=None), n)
        log.info("EVAL %d unpruned %s", step, {f: v["score"] for f, v in found.items()})
        if final:
            for m in ("random", "promprune", "divprune"):
                found = scores.family_scores(PrunedVLM(model, processor, method=m, budget=16), n)
                log.info("EVAL %d %s@16 %s", step, m, {f: v["score"] for f, v in found.items()})
    model.train()


def llm_stage(args):
    saved = torch.load(args.tower)
    targs = saved["args"]
    model, processor = make_model(targs["width"], targs["layers"], args.text_width, args.text_layers,
                                  args.text_heads, args.kv_heads, args.rope_theta)
    model.model.vision_tower.load_state_dict(saved["tower"])
    model.set_attn_implementation("eager")
    vlm = PrunedVLM(model, processor, method=None)
    tower = model.model.vision_tower.eval().requires_grad_(False)
    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    t0 = time.time()
    offset = 10_000_000  # train scenes the tower never saw
    params = list(model.model.multi_modal_projector.parameters())
    opt, sch = common.optimizer(params, args.align_steps, args.lr)
    for step in range(args.align_steps):
        batch = [training.train_scene(offset + step * 32 + i) for i in range(32)]
        with torch.no_grad():
            out = tower(pixels(processor, batch), output_hidden_states=True)
        common.step(training.align_loss(model, out, batch), params, opt, sch)
    offset += args.align_steps * 32
    log.info("align done (%.0fs)", time.time() - t0)
    layers = {"find": args.find_layer}
    if args.gather:
        layers["gather"] = args.gather_layer
    probe = Probe(args.text_width) if args.probe else None
    params = [p for p in model.parameters() if p.requires_grad] + (list(probe.parameters()) if probe else [])
    opt, sch = common.optimizer(params, args.steps, args.lr)
    model.train()
    image_id = model.config.image_token_id
    for step in range(args.steps):
        drawn = [training.example(offset + step * args.batch_size + i, rng) for i in range(args.batch_size)]
        kwargs, labels = common.teacher_forcing(vlm, *training._prompts(drawn))
        out = model(**kwargs, output_attentions=True, output_hidden_states=probe is not None)
        lm = common.lm_loss(out.logits, labels)
        masses = {} if (step + 1) % 250 == 0 else None
        sink = not args.no_sink and step >= args.sink_after
        at = attention_loss(out.attentions, attention_targets(kwargs, labels, drawn, image_id, sink),
                            layers, log_mass=masses)
        loss = lm + args.attn_weight * at
        if probe is not None:
            pl = probe.loss(out.hidden_states[args.find_layer], labels, drawn)
            loss = loss + pl
            if masses is not None:
                log.info("probe loss %.3f", pl.item())
        if masses:
            log.info("attn mass %s", {f: round(sum(v) / len(v), 2) for f, v in sorted(masses.items())})
        common.step(loss, params, opt, sch)
        if (step + 1) % 50 == 0:
            log.info("llm %d lm %.3f attn %.3f (%.0fs)", step + 1, lm.item(), at.item(), time.time() - t0)
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            evaluate(model, processor, args.eval_n, step + 1, step + 1 == args.steps)
    if args.save:
        model.eval()
        model.set_attn_implementation("sdpa")
        model.save_pretrained(args.save)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("stage", choices=("tower", "llm"))
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--text-width", type=int, default=96)
    ap.add_argument("--text-layers", type=int, default=4)
    ap.add_argument("--report-every", type=int, default=250)
    ap.add_argument("--save", default=None)
    ap.add_argument("--tower", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--align-steps", type=int, default=200)
    ap.add_argument("--find-layer", type=int, default=1)
    ap.add_argument("--gather", action="store_true")
    ap.add_argument("--gather-layer", type=int, default=0)
    ap.add_argument("--attn-weight", type=float, default=1.0)
    ap.add_argument("--no-sink", action="store_true")
    ap.add_argument("--sink-after", type=int, default=0)
    ap.add_argument("--probe", action="store_true")
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--eval-n", type=int, default=48)
    ap.add_argument("--rope-theta", type=float, default=None)
    ap.add_argument("--text-heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(1)
    {"tower": tower_stage, "llm": llm_stage}[args.stage](args)


if __name__ == "__main__":
    main()
