"""Vision once and prefix once: an image asked several questions is encoded, selected and prefilled once.

References: the unshared path of the same model (today's: every row preprocessed, encoded and prefilled by itself),
the processor's own output for every row, a count of the vision tower's calls, and a plain forward of the whole
prompt for the logits the cached prefix continues.
"""
import pytest
import torch
from transformers import LogitsProcessor

import promprune
from promprune.models import PrunedVLM
from promprune.models.options import all_methods
from promprune.models.sharing import ImageCache
from tests.models.conftest import ARCHS, make_image

# rows about two images, the first asked three questions (not all neighbours), the second two
KEYS = ["a", "a", "b", "a", "b"]
PROMPTS = ["What is it?", "Colour of the big thing here?", "Count?", "Is there a dog in the image?", "Where?"]
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def rows():
    pictures = {"a": make_image(40, 56, 0), "b": make_image(64, 30, 1)}
    return [pictures[k] for k in KEYS]


def vlm_for(arch, method=None, budget=None, **options):
    return PrunedVLM.from_pretrained(f"tiny:{arch}", method=method, budget=budget, **options)


class TowerCalls:
    """Counts the images the vision tower encodes (``get_image_features`` calls and their pixel batches)."""

    def __init__(self, vlm):
        self.calls, self.vlm = [], vlm
        self.original = vlm.model.model.get_image_features

    def __enter__(self):
        def counted(*args, **kwargs):
            self.calls.append(1)
            return self.original(*args, **kwargs)

        self.vlm.model.model.get_image_features = counted
        return self

    def __exit__(self, *exc):
        del self.vlm.model.model.get_image_features  # the class's method again


def tokens(generations):
    return [g.token_ids for g in generations]


def same_stats(mine: list[dict], theirs: list[dict]) -> bool:
    """Equal stats, the entropy to float32 rounding: a batched eigensolve's last bits depend on the batch it solves
    (5 rows there, 2 distinct images here), as they do between two batches of the unshared path."""
    for a, b in zip(mine, theirs):
        a, b = dict(a), dict(b)
        ea, eb = a.pop("entropy"), b.pop("entropy")
        if a != b or (ea is None) != (eb is None) or ea is not None and abs(ea - eb) > 1e-5 * max(1.0, abs(ea)):
            return False
    return len(mine) == len(theirs)


# (method, budget, options): unpruned, a saliency + coverage method, a merging one reading the tower's features,
# a pooling one reading the grid, and LLaVA-NeXT's released view layouts (view quota + newlines, packed)
CASES = [(None, None, {}), ("promprune", 8, {"token_order": "released"}), ("visionzip", 8, {}),
         ("downsample", 8, {})]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("method,budget,options", CASES)
def test_vision_once_is_bitwise_the_unshared_path(arch, method, budget, options, rows):
    if method == "visionzip" and arch not in ("llava", "llava_next"):
        options = {}  # VisionZip on the projected tokens (no tower features elsewhere): still a merging method
    vlm = vlm_for(arch, method, budget, **options)
    reference = vlm.prepare(rows, PROMPTS)
    with TowerCalls(vlm) as tower:
        shared = vlm.prepare(rows, PROMPTS, keys=KEYS)
    assert len(tower.calls) == 1  # one call, on the two distinct images
    for key in ("input_ids", "attention_mask", "position_ids"):
        if key in reference.model_kwargs:
            assert torch.equal(reference.model_kwargs[key], shared.model_kwargs[key]), key
    for mine, theirs in zip(reference.fed, shared.fed):
        assert torch.equal(mine.run_pos, theirs.run_pos)
        if promprune.method_spec(method).merges if method else False:
            # merged tokens are computed in the selection's batch (2 distinct images here, 5 rows there)
            torch.testing.assert_close(mine.features, theirs.features, rtol=1e-5, atol=1e-6)
        else:
            assert torch.equal(mine.features, theirs.features)  # the tower's own outputs, bit for bit
    assert same_stats(reference.stats, shared.stats)
    assert tokens(vlm.generate(rows, PROMPTS, max_new_tokens=NEW_TOKENS)) == \
        tokens(vlm.generate(rows, PROMPTS, keys=KEYS, max_new_tokens=NEW_TOKENS))


@pytest.mark.parametrize("arch", ARCHS)
def test_rows_are_the_processors_own(arch, rows):
    """The rows spliced from each image's placeholder segment equal the processor's output for every row."""
    from promprune.models import sharing

    vlm = vlm_for(arch)
    cache = ImageCache()
    vlm.prepare(rows, PROMPTS, keys=KEYS, cache=cache)
    assert all(s.segment is not None for s in cache.images.values())  # the splice fits every template
    spliced = sharing._rows(vlm, PROMPTS, [cache.images[k] for k in KEYS])
    processed = vlm.inputs(rows, PROMPTS)
    for key, value in spliced.items():
        assert torch.equal(value, processed[key]), key
    # besides the pixels, what only the vision encoding reads: OneVision's images per row, MiniCPM-V's grid per view
    assert {k for k in processed if not k.startswith("pixel_values")} <= set(spliced) | {"batch_num_images",
                                                                                          "target_sizes"}


@pytest.mark.parametrize("method,budget,options", [("vispruner", 10, {"budget_mode": "released"}),
                                                   ("divprune", 10, {"budget_mode": "released"}),
                                                   ("promprune", 12, {"budget_mode": "adaptive_views"})])
def test_llava_next_views_and_newlines(method, budget, options, rows):
    """LLaVA-NeXT's views (view quota on the full grids, every newline kept; the packed sequence; shares by entropy)
    keep their layout through both options."""
    vlm = vlm_for("llava_next", method, budget, **options)
    reference = vlm.generate(rows, PROMPTS, max_new_tokens=NEW_TOKENS)
    shared = vlm.generate(rows, PROMPTS, keys=KEYS, cache=ImageCache(), prefix_cache=True, max_new_tokens=NEW_TOKENS)
    assert tokens(reference) == tokens(shared)
    assert [(g.kept, g.visual_tokens, g.salient, g.saliency_count) for g in reference] == \
        [(g.kept, g.visual_tokens, g.salient, g.saliency_count) for g in shared]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("method,budget", [(None, None), ("promprune", 8), ("divprune", 6)])
def test_prefix_once_gives_the_same_greedy_answers(arch, method, budget, rows):
    """Two calls sharing one cache (the second reuses both images' prefixes): the answers of the unshared path."""
    vlm = vlm_for(arch, method, budget)
    reference = vlm.generate(rows, PROMPTS, max_new_tokens=NEW_TOKENS)
    cache = ImageCache()
    first = vlm.generate(rows[:3], PROMPTS[:3], keys=KEYS[:3], cache=cache, prefix_cache=True,
                         max_new_tokens=NEW_TOKENS)
    assert sorted(cache.prefixes) == ["a", "b"] and all(len(v) == 1 for v in cache.prefixes.values())
    with TowerCalls(vlm) as tower:
        second = vlm.generate(rows[3:], PROMPTS[3:], keys=KEYS[3:], cache=cache, prefix_cache=True,
                              max_new_tokens=NEW_TOKENS)
    assert not tower.calls  # both images were encoded by the first call
    assert tokens(reference) == tokens(first + second)
    assert [g.visual_tokens for g in reference] == [g.visual_tokens for g in first + second]
    assert [g.text_tokens for g in reference] == [g.text_tokens for g in first + second]


class FirstScores(LogitsProcessor):
    """Records the token ids and the scores of the first step as the caller's processors see them (after generate's
    own: its repetition penalty)."""

    def __init__(self):
        self.ids = self.scores = None

    def __call__(self, input_ids, scores):
        if self.scores is None:
            self.ids, self.scores = input_ids.clone(), scores.clone()
        return scores


@pytest.mark.parametrize("arch", ["llava", "qwen2_5_vl"])
def test_the_repetition_penalty_counts_a_rows_own_tokens_not_the_padding_inside_its_layout(arch, rows):
    """The prefix layout pads inside a row ([pad][prefix][pad][suffix]) and transformers' repetition penalty left out
    only the leading padding: the pad token counted as a repeated token of every row whose suffix was shorter than
    its batch mates', so its score was divided by the penalty or not with the batch (Qwen's pad is one of its end
    tokens). The penalised scores of every row are now the unshared path's (where the padding is in front only), pad
    token included, and so are the answers."""
    vlm = vlm_for(arch, "promprune", 8)
    kwargs = dict(max_new_tokens=NEW_TOKENS, repetition_penalty=1.3)
    plain, shared = FirstScores(), FirstScores()
    reference = vlm.generate(rows, PROMPTS, logits_processor=[plain], **kwargs)
    answers = vlm.generate(rows, PROMPTS, keys=KEYS, cache=ImageCache(), prefix_cache=True, logits_processor=[shared],
                           **kwargs)
    pad = vlm.processor.tokenizer.pad_token_id
    inside = [int((row[int((row != pad).int().argmax()):] == pad).sum()) for row in shared.ids]
    assert max(inside) > 0  # the layout pads inside some row (else this test could not fail)
    assert not any(pad in row[int((row != pad).int().argmax()):].tolist() for row in plain.ids)
    torch.testing.assert_close(shared.scores, plain.scores, rtol=0, atol=1e-5)
    assert tokens(answers) == tokens(reference)


def until_eos(vlm, ids: list[int]) -> list[int]:
    """An answer's tokens through its first end token (a batch pads a finished row's tokens after it)."""
    eos = vlm.model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    return ids[:next((i + 1 for i, t in enumerate(ids) if t in eos), len(ids))]


def test_no_repeat_ngram_sees_a_rows_own_tokens_not_its_batchs_padding(rows):
    """transformers' no-repeat-n-gram ban read every column of a padded batch: at size 1 it banned the pad token in
    every padded row, so a row whose answer (asked alone: no padding) holds the pad token answered otherwise in a
    batch, in either layout ([pad][prefix][pad][suffix] or left-padded). Each row now answers as it does alone, under
    transformers' own processor (a batch of one has no padding: nothing is swapped there); the caller's
    generation_config carries the setting and is left as it was."""
    from transformers import GenerationConfig

    vlm = vlm_for("llava", "promprune", 8)
    kwargs = dict(max_new_tokens=40, no_repeat_ngram_size=1)
    alone = [until_eos(vlm, vlm.generate([r], [p], **kwargs)[0].token_ids) for r, p in zip(rows, PROMPTS)]
    pad = vlm.processor.tokenizer.pad_token_id
    lengths = [len(vlm.processor.tokenizer(p).input_ids) for p in PROMPTS]
    # a row padded in the batch answers the pad token alone (else this test could not fail)
    assert any(pad in a and n < max(lengths) for a, n in zip(alone, lengths))
    plain = vlm.generate(rows, PROMPTS, **kwargs)
    config = GenerationConfig(**kwargs)
    shared = vlm.generate(rows, PROMPTS, keys=KEYS, cache=ImageCache(), prefix_cache=True, generation_config=config)
    assert config.no_repeat_ngram_size == 1
    assert [until_eos(vlm, g.token_ids) for g in plain] == alone
    assert [until_eos(vlm, g.token_ids) for g in shared] == alone


@pytest.mark.parametrize("size", [1, 2, 3])
@pytest.mark.parametrize("beams", [1, 2])
def test_the_attended_ngram_ban_is_transformers_ban_on_each_unpadded_row(size, beams):
    """On hand-made rows over a 6-token vocabulary (pad 0, 'visual' 5), padded in front and inside, whose generated
    tokens repeat the pad token and the tokens around the padding: the scores equal transformers' processor on each
    row alone without its padding; transformers' on the padded rows differs for some (non-vacuous)."""
    from transformers import NoRepeatNGramLogitsProcessor

    from promprune.models.prefix import AttendedNoRepeatNGram

    real = [[1, 5, 5, 2, 3], [5, 4, 3], [1, 2, 5, 5, 5, 3, 4, 2]]  # the prompts unpadded
    mask = torch.tensor([[0, 1, 1, 1, 0, 0, 1, 1], [0, 0, 0, 1, 0, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1, 1]])
    prompt = torch.zeros_like(mask)
    for b, ids in enumerate(real):
        prompt[b, mask[b].bool()] = torch.tensor(ids)
    generated = torch.tensor([[0, 5, 0, 2], [5, 0, 5, 4], [5, 3, 0, 0]])
    attended = AttendedNoRepeatNGram(size, mask)
    differs = False
    for step in range(generated.shape[1] + 1):
        ids = torch.cat([prompt, generated[:, :step]], 1).repeat_interleave(beams, 0)
        scores = torch.randn(ids.shape[0], 6)
        got = attended(ids, scores.clone())
        for r in range(ids.shape[0]):
            alone = torch.tensor([real[r // beams] + generated[r // beams, :step].tolist()])
            want = NoRepeatNGramLogitsProcessor(size)(alone, scores[r:r + 1].clone())
            assert torch.equal(got[r:r + 1], want), (step, r)
        differs |= not torch.equal(NoRepeatNGramLogitsProcessor(size)(ids, scores.clone()), got)
    assert differs


def test_the_ngram_ban_is_left_to_transformers_where_it_cannot_move(rows):
    """Unpadded rows, a processor of the caller's own, or a knob whose processor sits between generate's ban and the
    caller's (forcing a token, or making -inf finite) and does not commute with a ban: nothing is swapped."""
    from transformers import NoRepeatNGramLogitsProcessor

    from promprune.models.prefix import AttendedNoRepeatNGram, no_repeat_ngram

    model = vlm_for("llava").model
    padded, whole = torch.tensor([[0, 1, 1], [1, 1, 1]]), torch.ones(2, 3, dtype=torch.long)
    swapped, processors = no_repeat_ngram(model, {"no_repeat_ngram_size": 2}, padded)
    assert swapped["no_repeat_ngram_size"] == 0 and isinstance(processors[0], AttendedNoRepeatNGram)
    for kwargs, mask in [({"no_repeat_ngram_size": 2}, whole), ({}, padded),
                         ({"no_repeat_ngram_size": 2, "logits_processor": [NoRepeatNGramLogitsProcessor(2)]}, padded),
                         ({"no_repeat_ngram_size": 2, "forced_eos_token_id": 0}, padded),
                         ({"no_repeat_ngram_size": 2, "remove_invalid_values": True}, padded)]:
        assert no_repeat_ngram(model, kwargs, mask) == (kwargs, [])


def numbered(kwargs: dict) -> dict:
    """Model kwargs with the positions ``generate`` gives a plain forward where the adapter gives none: the mask's
    running count (a plain forward would number the padding too)."""
    if kwargs.get("position_ids") is not None:
        return kwargs
    mask = kwargs["attention_mask"]
    return {**kwargs, "position_ids": (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)}


@pytest.mark.parametrize("arch", ["llava", "qwen2_5_vl", "qwen3_vl"])
def test_the_cached_prefix_continues_the_whole_prompt(arch, rows):
    """The first answer token's logits through the cached prefix equal a plain forward of the whole prompt (Qwen:
    its 3D M-RoPE positions moved with the columns; Qwen3-VL: the DeepStack rows entered in the prefix)."""
    from promprune.models import prefix
    from promprune.models.llm_hooks import cache_argument

    vlm = vlm_for(arch, "promprune", 8)
    prep = vlm.prepare(rows, PROMPTS, keys=KEYS)
    with torch.inference_mode():
        whole = vlm.model(**numbered(prep.model_kwargs)).logits[:, -1]
        cached = numbered(prefix.inputs(vlm, prep, ImageCache()))
        # every real column keeps the position it has in the whole prompt
        pos, mask = cached["position_ids"], cached["attention_mask"].bool()
        full = numbered(prep.model_kwargs)["position_ids"]
        for b in range(len(rows)):
            real = prep.model_kwargs["attention_mask"][b].bool()
            assert torch.equal(pos[..., b, :][..., mask[b]], full[..., b, :][..., real])
        length = cached[cache_argument(vlm.model)].get_seq_length()
        suffix = {k: v[..., length:] if k in ("input_ids", "position_ids") else v for k, v in cached.items()}
        continued = vlm.model(**suffix).logits[:, -1]
    torch.testing.assert_close(continued, whole, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("method", [m for m in all_methods() if promprune.method_spec(m).question_dependent])
def test_question_dependent_methods_keep_their_per_question_work(method, rows):
    """The in-LLM methods prune inside the LLM per question: the image is encoded once, every prompt prefilled whole;
    CDPruner selects per question: keys are ignored, every row is encoded."""
    vlm = vlm_for("llava", method, 8)
    in_llm = promprune.method_spec(method).stage == promprune.IN_LLM
    assert not vlm.shares_prefix and vlm.shares_vision is in_llm
    cache = ImageCache()
    with TowerCalls(vlm) as tower:
        shared = vlm.generate(rows, PROMPTS, keys=KEYS, cache=cache, prefix_cache=True, max_new_tokens=NEW_TOKENS)
    assert len(tower.calls) == 1 and not cache.prefixes  # one call: on the two images (in-LLM), on all five rows
    assert len(cache) == (2 if in_llm else 0)
    reference = vlm.generate(rows, PROMPTS, max_new_tokens=NEW_TOKENS)
    assert tokens(shared) == tokens(reference)
    assert [(g.visual_tokens, g.kept) for g in shared] == [(g.visual_tokens, g.kept) for g in reference]


def test_sharing_follows_the_registry():
    unpruned = PrunedVLM.from_pretrained("tiny:llava", method=None)
    assert unpruned.shares_vision and unpruned.shares_prefix
    for method in all_methods():
        spec = promprune.method_spec(method)
        dependent = spec.stage == promprune.IN_LLM or spec.needs_instruction
        assert spec.question_dependent is dependent
        vlm = vlm_for("llava", method, 8)
        assert vlm.shares_prefix is not dependent
        assert vlm.shares_vision is (spec.stage == promprune.IN_LLM or not dependent)


def test_a_prompt_without_a_suffix_falls_back(rows):
    """A prompt that ends with its visual tokens (nothing to prefill over the prefix) runs the usual way."""
    from promprune.models import prefix

    ids = torch.tensor([[5, 7, 9, 9], [0, 5, 9, 6]])
    mask = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])
    assert prefix.split(ids, mask, torch.tensor([9])) is None
    parts = prefix.split(ids[1:], mask[1:], torch.tensor([9]))
    assert parts.prefix[0].tolist() == [1, 2] and parts.suffix[0].tolist() == [3]


def test_images_asked_once_each_are_not_prefilled_apart(rows):
    """A batch whose images are each asked once, none cached, runs the unshared way (nothing to reuse); once an
    image's prefix is cached, a batch asking it again continues it."""
    from promprune.models import prefix

    vlm = vlm_for("llava", "promprune", 8)
    cache = ImageCache()
    once = vlm.prepare(rows[1:3], PROMPTS[1:3], keys=["a", "b"], cache=cache)
    assert prefix.inputs(vlm, once, cache) is None and not cache.prefixes
    twice = vlm.prepare(rows[:2], PROMPTS[:2], keys=["a", "a"], cache=cache)
    assert prefix.inputs(vlm, twice, cache) is not None and list(cache.prefixes) == ["a"]
    assert prefix.inputs(vlm, once, cache) is not None  # "a" is cached now: the batch continues it


def test_prefix_once_passes_the_cache_under_the_name_this_release_takes(rows):
    """transformers 5.24 renamed the cache argument of forward and generate (past_key_values -> cache, the old name
    deprecated until 5.40): the cached prefix goes in under the name the model's forward declares, so no release in
    pyproject.toml's range warns or breaks. Under the pinned release this is past_key_values; the canary runs it on
    the newest."""
    import inspect
    import warnings

    from promprune.models.llm_hooks import cache_argument

    vlm = vlm_for("llava", "promprune", 8)
    params = inspect.signature(vlm.model.forward).parameters
    assert cache_argument(vlm.model) == ("cache" if "cache" in params else "past_key_values")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*past_key_values.*deprecated", category=FutureWarning)
        shared = vlm.generate(rows, PROMPTS, keys=KEYS, cache=ImageCache(), prefix_cache=True,
                              max_new_tokens=NEW_TOKENS)
    assert tokens(shared) == tokens(vlm.generate(rows, PROMPTS, max_new_tokens=NEW_TOKENS))


@pytest.mark.parametrize("kwargs", [{"use_cache": False}, {"cache_implementation": "static"},
                                    {"cache_implementation": "dynamic"}])
def test_prefix_once_gives_way_to_a_cache_setting_of_the_callers(kwargs, rows):
    """The prefix cache hands generate a filled dynamic cache: with use_cache=False generate read none of it and
    answered wrongly, silently; with a cache_implementation transformers refused the pair ("Passing both
    `cache_implementation` ... and `past_key_values`"). Then the usual way runs: the answers of the unshared path,
    no prefix cached."""
    vlm = vlm_for("llava", "divprune", 6)
    reference = vlm.generate(rows, PROMPTS, max_new_tokens=NEW_TOKENS)
    cache = ImageCache()
    shared = vlm.generate(rows, PROMPTS, keys=KEYS, cache=cache, prefix_cache=True, max_new_tokens=NEW_TOKENS,
                          **kwargs)
    assert tokens(shared) == tokens(reference) and not cache.prefixes


def test_cache_argument_follows_the_forward_signature():
    """Hand-made forwards: the 5.24 name when declared, else the old one."""
    from promprune.models.llm_hooks import cache_argument

    class New(torch.nn.Module):
        def forward(self, input_ids=None, cache=None, **kwargs):
            return input_ids

    class Old(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None, **kwargs):
            return input_ids

    assert cache_argument(New()) == "cache" and cache_argument(Old()) == "past_key_values"


def test_a_none_key_is_no_key(rows):
    """``Request.image_key`` may be None (an image without an identity): such rows are each an image of their own, as
    ``run_requests`` takes them, not one image shared by every None (which answered the second image with the
    first's tokens), and the cache keeps nothing of them after the call."""
    vlm = vlm_for("llava", "promprune", 4)
    images, prompts = [rows[0], rows[2], rows[2], rows[0], rows[2]], ["What is it?", "Where?", "Count?"] * 2
    prompts = prompts[:5]
    reference = vlm.generate(images, prompts, max_new_tokens=NEW_TOKENS)
    assert reference[0].kept != reference[1].kept  # two images, two selections: the test can tell them apart
    cache = ImageCache()
    got = vlm.generate(images, prompts, keys=[None, "a", "a", None, None], cache=cache, prefix_cache=True,
                       max_new_tokens=NEW_TOKENS)
    assert tokens(got) == tokens(reference) and [g.kept for g in got] == [g.kept for g in reference]
    assert list(cache.images) == ["a"] and list(cache.prefixes) == ["a"]


def test_a_cache_another_wrapper_filled_never_answers_for_this_one(rows):
    """One ImageCache passed to a second wrapper of the same model used to hand it the first wrapper's pruned tokens
    (entries were found by the image's key alone): its answers and `kept` were the first method's under its own
    name, and at another budget it failed inside transformers ("Image features and image tokens do not match").
    Each wrapper's answers with a cache another filled are now its own unshared answers; it reuses its own results."""
    base = vlm_for("llava")
    first = PrunedVLM(base.model, base.processor, method="downsample", budget=8)
    second = PrunedVLM(base.model, base.processor, method="promprune", budget=8)
    smaller = PrunedVLM(base.model, base.processor, method="downsample", budget=4)
    references = {id(v): v.generate(rows, PROMPTS, max_new_tokens=NEW_TOKENS) for v in (first, second, smaller)}
    cache = ImageCache()
    for vlm in (first, second, smaller, first):
        got = vlm.generate(rows, PROMPTS, keys=KEYS, cache=cache, prefix_cache=True, max_new_tokens=NEW_TOKENS)
        reference = references[id(vlm)]
        assert tokens(got) == tokens(reference) and [g.kept for g in got] == [g.kept for g in reference]
        assert [g.visual_tokens for g in got] == [g.visual_tokens for g in reference]
    with TowerCalls(first) as tower:  # the images' entries are its own now: nothing encoded again
        first.generate(rows, PROMPTS, keys=KEYS, cache=cache, prefix_cache=True, max_new_tokens=NEW_TOKENS)
    assert not tower.calls and sorted(cache.images) == ["a", "b"] and sorted(cache.prefixes) == ["a", "b"]
    cache.release("a")
    assert "a" not in cache.owners and "b" in cache.owners


def test_the_prefix_cache_never_continues_another_wrappers_prefix(rows):
    """`prefix.inputs` given a cache another wrapper filled (its prefixes' tokens alike: another method at the same
    budget) prefills this wrapper's own prefixes: the first answer token's logits are those of a plain forward of this
    wrapper's whole prompt. It claimed the keys itself until 9d5fc6d left that to `sharing.prepare`, whose cache a
    caller of `prefix.inputs` need not pass it: then it continued the other method's keys and values."""
    from promprune.models import prefix
    from promprune.models.llm_hooks import cache_argument

    base = vlm_for("llava")
    first = PrunedVLM(base.model, base.processor, method="downsample", budget=8)
    second = PrunedVLM(base.model, base.processor, method="promprune", budget=8)
    cache = ImageCache()
    first.generate(rows, PROMPTS, keys=KEYS, cache=cache, prefix_cache=True, max_new_tokens=1)
    assert sorted(cache.prefixes) == ["a", "b"]
    prep = second.prepare(rows, PROMPTS, keys=KEYS)  # a cache of its own: this call's only
    with torch.inference_mode():
        whole = second.model(**numbered(prep.model_kwargs)).logits[:, -1]
        cached = numbered(prefix.inputs(second, prep, cache))
        length = cached[cache_argument(second.model)].get_seq_length()
        suffix = {k: v[..., length:] if k in ("input_ids", "position_ids") else v for k, v in cached.items()}
        continued = second.model(**suffix).logits[:, -1]
        # the test can tell the methods apart: the first wrapper's own prompt ends elsewhere
        other = first.model(**numbered(first.prepare(rows, PROMPTS).model_kwargs)).logits[:, -1]
    assert (other - whole).abs().max() > 1e-3
    torch.testing.assert_close(continued, whole, rtol=1e-4, atol=1e-4)
    assert all(cache.owners[k] == second.cache_owner for k in ("a", "b"))
