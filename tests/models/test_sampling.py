"""Per-row seeded sampling (promprune.models.sampling): each row draws from its own stream, from the distribution
transformers' generate(do_sample=True) samples."""
import numpy as np
import pytest
import torch
from PIL import Image
from scipy import stats
from transformers import LogitsProcessor

from promprune.models import PrunedVLM
from promprune.models.sampling import GumbelNoise, per_row_sampling, warpers
from promprune.models.sharing import ImageCache

from .conftest import make_image


@pytest.fixture(scope="module")
def vlm():
    return PrunedVLM.from_pretrained("tiny:llava", method="promprune", budget=8)


def _chi2(counts, probs) -> float:
    """Pearson's chi-square p-value of ``counts`` against ``probs`` (bins expected under 5 draws pooled); 0 when
    something was drawn where the law puts no mass."""
    counts, probs = np.asarray(counts, float), np.asarray(probs, float)
    if counts[probs == 0].sum():
        return 0.0
    expected = probs * counts.sum()
    small = (expected < 5) & (expected > 0)
    big = expected >= 5
    obs = np.append(counts[big], counts[small].sum())
    exp = np.append(expected[big], expected[small].sum())
    keep = exp > 0
    return stats.chisquare(obs[keep], exp[keep]).pvalue


def _softmax(x):
    x = np.asarray(x, np.float64)
    e = np.exp(x - x[np.isfinite(x)].max())
    return e / e.sum()


def _reference(logits, *, temperature=1.0, top_k=None, top_p=None, penalty=None, prompt_ids=()):
    """The sampling law written out by hand (float64, numpy): repetition penalty on the prompt's tokens, then
    temperature, top-k, top-p (the smallest set of the likeliest tokens whose mass reaches top_p), as transformers'
    documentation describes them."""
    x = np.asarray(logits, np.float64).copy()
    if penalty is not None:
        for t in set(int(i) for i in prompt_ids):
            x[t] = x[t] * penalty if x[t] < 0 else x[t] / penalty
    x = x / temperature
    if top_k is not None:
        x[np.argsort(-x, kind="stable")[top_k:]] = -np.inf
    if top_p is not None:
        order = np.argsort(x, kind="stable")  # ascending, as TopPLogitsWarper
        mass = np.cumsum(_softmax(x)[order])
        drop = mass <= 1 - top_p
        drop[-1] = False  # the likeliest token is always kept
        x[order[drop]] = -np.inf
    return _softmax(x)


def test_gumbel_argmax_draws_from_the_softmax():
    """argmax(scores + Gumbel noise) is a draw from softmax(scores): 20000 rows, each of its own seed, against the
    softmax (chi-square); a token at -inf is never drawn. The same draws are far from a wrong law (the test can fail),
    and a row's draw depends on its seed and the step only."""
    scores = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -float("inf"), 1.5])
    n = 20000
    noise = GumbelNoise(list(range(n)))
    ids = torch.zeros(n, 3, dtype=torch.long)
    drawn = noise(ids, scores.expand(n, -1).clone()).argmax(-1)
    counts = np.bincount(drawn.numpy(), minlength=len(scores))
    law = _softmax(scores.numpy())
    assert counts[5] == 0
    assert _chi2(counts, law) > 1e-3
    assert _chi2(counts, _softmax(scores.numpy() / 1.2)) < 1e-6  # the power to tell a temperature of 1.2 apart
    # the next step draws anew (another stream), from the same law
    later = noise(torch.zeros(n, 4, dtype=torch.long), scores.expand(n, -1).clone()).argmax(-1)
    assert (later != drawn).float().mean() > 0.5
    assert _chi2(np.bincount(later.numpy(), minlength=len(scores)), law) > 1e-3
    # row 7's draws alone, or among other rows in another order: its seed's, whatever is beside it
    alone, mixed = GumbelNoise([7]), GumbelNoise([99, 7, 3])
    for length in (3, 4):  # steps 0 and 1 (each counts its steps from its first call)
        assert torch.equal(alone(torch.zeros(1, length, dtype=torch.long), scores[None].clone()),
                           mixed(torch.zeros(3, length, dtype=torch.long), scores.expand(3, -1).clone())[1:2])


def test_the_warpers_are_the_ones_generate_applies_when_sampling(vlm):
    """The warpers come from transformers' own merge of the kwargs over the model's generation config: a
    temperature alone samples with transformers' default top-k of 50, as generate(do_sample=True) does."""
    names = [type(p).__name__ for p in warpers(vlm.model, {"do_sample": True, "temperature": 0.7})]
    assert names == ["TemperatureLogitsWarper", "TopKLogitsWarper"]
    built = warpers(vlm.model, {"do_sample": True, "temperature": 0.5, "top_k": 3, "top_p": 0.8})
    assert [type(p).__name__ for p in built] == ["TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper"]
    assert built[0].temperature == 0.5 and built[1].top_k == 3 and built[2].top_p == 0.8
    kwargs, processors = per_row_sampling(vlm.model, {"do_sample": True, "temperature": 0.5, "max_new_tokens": 2},
                                          [1, 2])
    assert kwargs == {"do_sample": False, "max_new_tokens": 2} and isinstance(processors[-1], GumbelNoise)
    with pytest.raises(ValueError, match="num_beams must be 1"):
        per_row_sampling(vlm.model, {"do_sample": True, "num_beams": 2}, [1, 2])


def _first_tokens(vlm, image, prompt, n, **kwargs):
    gens = vlm.generate([image] * n, [prompt] * n, keys=["a"] * n, cache=ImageCache(), max_new_tokens=1,
                        do_sample=True, **kwargs)
    return np.array([g.token_ids[0] for g in gens])


@pytest.mark.parametrize("settings,shaped_by", [
    # transformers' default top_k=50 applies (the tiny model's logits are nearly flat: about uniform over the top 50)
    ({"temperature": 2.0}, ["top_k"]),
    ({"temperature": 0.05, "top_k": 12, "top_p": 0.9, "repetition_penalty": 1.3},
     ["temperature", "top_k", "top_p", "penalty"]),
])
def test_a_seeded_rows_first_token_follows_generates_sampling_law(vlm, settings, shaped_by):
    """1500 rows of one question, each with its own seed: their first tokens against the law written out by hand
    from the model's logits (chi-square), and against transformers' own multinomial sampling of the same batch
    (a two-sample test)."""
    image, prompt, n = make_image(40, 56, 0), "What is in the picture?", 1500
    prep = vlm.prepare([image], [prompt])
    out = vlm.model.generate(**prep.model_kwargs, max_new_tokens=1, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    logits = out.logits[0][0].double().numpy()
    law = _reference(logits, temperature=settings["temperature"], top_k=settings.get("top_k", 50),
                     top_p=settings.get("top_p"), penalty=settings.get("repetition_penalty"),
                     prompt_ids=prep.model_kwargs["input_ids"][0].tolist())
    assert (law > 0).sum() >= 5  # a law with several outcomes
    ours = np.bincount(_first_tokens(vlm, image, prompt, n, sample_seeds=list(range(n)), **settings),
                       minlength=len(law))
    assert _chi2(ours, law) > 1e-3
    # the draws tell the law apart from the law without each setting that shapes it (the test can fail)
    given = dict(temperature=settings["temperature"], top_k=settings.get("top_k", 50), top_p=settings.get("top_p"),
                 penalty=settings.get("repetition_penalty"), prompt_ids=prep.model_kwargs["input_ids"][0].tolist())
    without = {"temperature": settings["temperature"] * 1.5, "top_k": None, "top_p": None, "penalty": None}
    for name in shaped_by:
        assert _chi2(ours, _reference(logits, **{**given, name: without[name]})) < 1e-6, name
    torch.manual_seed(0)
    native = np.bincount(_first_tokens(vlm, image, prompt, n, **settings), minlength=len(law))
    assert native[law == 0].sum() == 0
    seen = (ours + native) > 0
    assert stats.chi2_contingency(np.stack([ours[seen], native[seen]])).pvalue > 1e-3


class _EndRows(LogitsProcessor):
    """Ends the given rows at the second step (only the end-of-sequence token left)."""

    def __init__(self, rows, eos):
        self.rows, self.eos, self.calls = rows, eos, 0

    def __call__(self, input_ids, scores):
        self.calls += 1
        if self.calls >= 2:
            for r in self.rows:
                scores[r] = -float("inf")
                scores[r, self.eos] = 0.0
        return scores


def test_a_rows_sampled_answer_is_its_seeds_in_any_batch(vlm):
    """A row's sampled tokens are the same alone, beside other rows (in either order, with prompts of other lengths:
    left padding), beside a row that finishes at once, and with the prefix cache; another seed draws others.
    Greedy ignores the seeds."""
    images = [make_image(40, 56, 0), make_image(64, 30, 1), Image.new("RGB", (32, 32), "red")]
    prompts = ["What is in the picture?", "Describe the colours of this image in a few words, please.", "Red?"]
    kw = dict(max_new_tokens=6, do_sample=True, temperature=3.0, top_k=100)

    def tokens(idx, seeds, **extra):
        gens = vlm.generate([images[i] for i in idx], [prompts[i] for i in idx], sample_seeds=seeds, **kw, **extra)
        return [g.token_ids for g in gens]

    alone = tokens([0], [11])[0]
    assert tokens([1, 0], [5, 11])[1] == alone
    assert tokens([0, 2, 1], [11, 6, 5])[0] == alone
    assert tokens([2, 0], [6, 11], keys=["r", "p"], cache=ImageCache(), prefix_cache=True)[1] == alone
    eos = vlm.model.generation_config.eos_token_id
    ended, kept = tokens([1, 0], [5, 11], logits_processor=[_EndRows([0], eos)])
    assert ended[1] == eos and kept == alone
    assert tokens([0], [12])[0] != alone
    greedy = vlm.generate([images[0]], [prompts[0]], max_new_tokens=6)
    assert vlm.generate([images[0]], [prompts[0]], max_new_tokens=6, sample_seeds=[11])[0].token_ids == \
        greedy[0].token_ids
    with pytest.raises(ValueError, match="one int per row"):
        vlm.generate([images[0]], [prompts[0]], sample_seeds=[1, 2], **kw)


def test_a_generation_config_samples_as_transformers_merges_it(vlm):
    """``generate(generation_config=GenerationConfig(do_sample=True, ...))`` decoded greedily: PrunedVLM's default
    ``do_sample=False`` (and ``num_beams=1``) kwarg overrode the config. The config is now merged as transformers'
    generate merges it (a kwarg wins only where the caller passes one): with seeds, each row draws as the same settings
    given as kwargs draw; without, the tokens are plain transformers' generate with that config under one torch seed."""
    from transformers import GenerationConfig

    images = [make_image(40, 56, 0), make_image(64, 30, 1), Image.new("RGB", (32, 32), "red")]
    prompts = ["What is in the picture?", "Describe the colours of this image in a few words, please.", "Red?"]
    settings = dict(do_sample=True, temperature=3.0, top_k=100, max_new_tokens=6)
    config = GenerationConfig(**settings)
    before = config.to_dict()
    seeds = [11, 5, 6]

    def tokens(**kwargs):
        return [g.token_ids for g in vlm.generate(images, prompts, **kwargs)]

    greedy = tokens(max_new_tokens=6)
    by_kwargs = tokens(sample_seeds=seeds, **settings)
    assert by_kwargs != greedy
    assert tokens(generation_config=config, sample_seeds=seeds) == by_kwargs
    assert [g.token_ids for g in vlm.generate(images[:1], prompts[:1], generation_config=config,
                                              sample_seeds=seeds[:1])] == by_kwargs[:1]  # per row: alone too
    assert tokens(generation_config=config, sample_seeds=seeds, keys=["a", "b", "c"], cache=ImageCache(),
                  prefix_cache=True) == by_kwargs
    # a kwarg the caller passes wins over the config's field, as in transformers
    assert tokens(generation_config=config, do_sample=False) == greedy
    assert tokens(generation_config=config, sample_seeds=seeds, temperature=0.5) == \
        tokens(sample_seeds=seeds, **{**settings, "temperature": 0.5})
    # unseeded: transformers' own sampling of the same config
    prep = vlm.prepare(images, prompts)
    torch.manual_seed(3)
    plain = vlm.model.generate(**prep.model_kwargs, generation_config=config)
    plain = plain[:, prep.model_kwargs["input_ids"].shape[1]:]
    torch.manual_seed(3)
    ours = tokens(generation_config=config)
    assert ours == plain.tolist() and ours != greedy
    # a config's num_beams is honoured too (it was overridden by num_beams=1); sampled beams still refused with seeds
    assert tokens(generation_config=GenerationConfig(num_beams=3, max_new_tokens=6)) == \
        tokens(num_beams=3, max_new_tokens=6)
    with pytest.raises(ValueError, match="num_beams must be 1"):
        tokens(generation_config=GenerationConfig(num_beams=2, **settings), sample_seeds=seeds)
    assert config.to_dict() == before  # the caller's config is never changed
