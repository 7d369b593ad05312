"""Every registered method runs through every adapter; names and options are validated up front."""
import io

import pytest
import torch

import promprune
from promprune.models import PrunedVLM, all_methods, is_in_llm, validate_method
from promprune.models.tiny import tiny_vlm

from .conftest import ARCHS

BUDGET = 6


def test_all_methods_is_registry_plus_in_llm():
    in_llm = ["dart", "fastv", "pyramiddrop", "sparsevlm"]
    assert set(all_methods()) == set(promprune.methods()) | set(in_llm)
    assert promprune.methods(promprune.IN_LLM) == in_llm
    assert [m for m in all_methods() if is_in_llm(m)] == in_llm


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("method", all_methods())
def test_every_method_runs_through_every_adapter(arch, method, images, prompts):
    model, processor = tiny_vlm(arch)
    out = PrunedVLM(model, processor, method=method, budget=BUDGET).generate(images, prompts, max_new_tokens=3)
    assert len(out) == 2
    for g in out:
        assert isinstance(g.text, str) and len(g.token_ids) == 3
        assert g.visual_tokens == BUDGET
        if not is_in_llm(method):  # NeXT in-LLM methods may keep image_newline placeholders
            cls_tokens = BUDGET - len(g.kept)  # VisionZip also feeds each view's CLS, which has no grid index
            assert cls_tokens == 0 or method == "visionzip" and "qwen" not in arch and cls_tokens >= 1
        assert len(set(g.kept)) == len(g.kept)
        if arch not in ("llava_next", "llava_onevision"):  # raster order is grid order (anyres: the packed layout)
            assert g.kept == sorted(g.kept)
        assert 0 <= g.saliency_count <= BUDGET
        assert min(g.vision_ms, g.select_ms, g.prefill_ms, g.decode_ms) >= 0


def test_the_registry_reserves_the_adapter_options_and_the_wrappers_arguments():
    """The registry lists, without importing promprune.models, the names PrunedVLM takes before a method's options
    (a method option so named went to the adapter or the wrapper, silently): exactly the adapter options and the
    keyword arguments of PrunedVLM and PrunedVLM.from_pretrained."""
    import inspect

    from promprune.models import ADAPTER_OPTIONS
    from promprune.selection import registry

    assert registry.ADAPTER_OPTION_NAMES == set(ADAPTER_OPTIONS)
    params = {p.name for f in (PrunedVLM.__init__, PrunedVLM.from_pretrained)
              for p in inspect.signature(f).parameters.values() if p.kind is not p.VAR_KEYWORD}
    assert registry.WRAPPER_ARGUMENTS == params - {"self", "cls"}
    for name in (*registry.ADAPTER_OPTION_NAMES, *registry.WRAPPER_ARGUMENTS):
        assert not any(name in promprune.method_spec(m).options for m in all_methods()), name


def test_mu_defaults_per_encoder_unless_given():
    llava, p1 = tiny_vlm("llava")
    qwen, p2 = tiny_vlm("qwen2_5_vl")
    assert PrunedVLM(llava, p1, budget=4).method_options["mu"] == 0.42
    assert PrunedVLM(qwen, p2, budget=4).method_options["mu"] == 0.5744
    assert PrunedVLM(qwen, p2, budget=4, mu=0.3).method_options["mu"] == 0.3
    assert "mu" not in PrunedVLM(qwen, p2, method="divprune", budget=4).method_options
    qwen3, p3 = tiny_vlm("qwen3_vl")
    assert PrunedVLM(qwen3, p3, budget=4).method_options["mu"] == 0.5744  # borrowed from Qwen2.5-VL (uncalibrated)
    onevision, p4 = tiny_vlm("llava_onevision")
    assert PrunedVLM(onevision, p4, budget=4).method_options["mu"] == 0.42  # SigLIP borrows CLIP's (uncalibrated)


@pytest.mark.parametrize("call,match", [
    (lambda: validate_method("promprun", 4), "did you mean 'promprune'"),
    (lambda: validate_method("promprune", 4, muu=0.3), "unknown option.*'muu'.*valid options"),
    (lambda: validate_method("promprune", None), "budget must be a positive int"),
    (lambda: validate_method("fastv", 0), "budget must be a positive int"),
    (lambda: validate_method("fastv", 4, layer=0), "'layer' of fastv"),
    (lambda: validate_method("sparsevlm", 4, recycle_ratio=2), "'recycle_ratio'"),
    (lambda: validate_method("promprune", 4, diversity="kmeans"), "diversity"),
    (lambda: validate_method("promprune", 4, budget_mode="per_view"), "budget_mode"),
    (lambda: validate_method("promprune", 4, image_tokens=10), "image_tokens"),
    (lambda: validate_method("promprune", 4, image_tokens=0), "image_tokens"),  # 0 = 0^2 passed: fails in processor
    (lambda: validate_method("promprune", 4, image_tokens=16.0), "image_tokens"),
    (lambda: validate_method(None, 4), "takes no budget"),
])
def test_bad_method_or_options_fail_early(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_from_pretrained_validates_before_loading():
    with pytest.raises(ValueError, match="unknown method"):
        PrunedVLM.from_pretrained("/nonexistent/checkpoint", method="nope", budget=4)


def test_from_pretrained_tiny_and_checkpoint_dir(tmp_path, images, prompts):
    """``tiny:<arch>`` and a saved checkpoint directory load through the same ordinary path."""
    vlm = PrunedVLM.from_pretrained("tiny:llava", method="divprune", budget=4)
    model, processor = vlm.model, vlm.processor
    assert model is not tiny_vlm("llava")[0]  # a private copy
    model.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    loaded = PrunedVLM.from_pretrained(str(tmp_path), method="divprune", budget=4)
    a = vlm.generate(images, prompts, max_new_tokens=3)
    b = loaded.generate(images, prompts, max_new_tokens=3)
    assert [g.token_ids for g in a] == [g.token_ids for g in b]


def test_corrupt_image_names_the_item(images, prompts):
    model, processor = tiny_vlm("llava")
    buf = io.BytesIO()
    images[0].save(buf, format="PNG")
    truncated = buf.getvalue()[: len(buf.getvalue()) // 2]
    vlm = PrunedVLM(model, processor, method="divprune", budget=4)
    with pytest.raises(ValueError, match="image 1 is corrupt or unreadable"):
        vlm.generate([images[0], truncated], prompts)
    with pytest.raises(ValueError, match="image 0 is corrupt or unreadable"):
        vlm.generate(["/nonexistent.png", images[1]], prompts)
    with pytest.raises(ValueError, match="2 images but 1 prompts"):
        vlm.generate(images, prompts[:1])


def test_a_bare_prompt_or_image_is_refused_naming_the_argument(images, prompts, tmp_path):
    """A prompt string was iterated as one prompt per character ("got 1 images but 5 prompts"); a bare image was a
    raw TypeError ('Image' object is not iterable), a bare path a list of its characters. Refused before anything is
    processed, naming the argument and the list it expects."""
    vlm = PrunedVLM(*tiny_vlm("llava"), method="divprune", budget=4)
    path = tmp_path / "a.png"
    images[0].save(path)
    for call in (vlm.generate, vlm.prepare, vlm.inputs):
        with pytest.raises(ValueError, match=r"^prompts must be a list with one prompt per batch row \(e\.g\. "
                                             r"\[prompt\]\), got str 'hello': wrap a single prompt in a list$"):
            call([images[0]], "hello")
        for bare, kind in ((images[0], "Image"), (str(path), "str"), (path, "PosixPath"), (b"png", "bytes")):
            with pytest.raises(ValueError, match=rf"^images must be a list with one image per batch row \(e\.g\. "
                                                 rf"\[image\]\), got {kind} .*: wrap a single image in a list$"):
                call(bare, ["hello"])
        with pytest.raises(ValueError, match=r"^images must be a list .*, got int 3"):
            call(3, ["hello"])
    assert len(vlm.generate((images[0],), ("hello",), max_new_tokens=1)) == 1  # a tuple is a batch


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("method", ["promprune", "fastv"])
def test_half_precision(dtype, method, images, prompts):
    vlm = PrunedVLM.from_pretrained("tiny:qwen2_5_vl", method=method, budget=5, dtype=dtype)
    out = vlm.generate(images, prompts, max_new_tokens=2)
    assert vlm.model.dtype == dtype and [g.visual_tokens for g in out] == [5, 5]


def test_tiny_from_pretrained_accepts_auto_and_strings():
    vlm = PrunedVLM.from_pretrained("tiny:qwen2_5_vl", method=None, dtype="auto", device_map="auto")
    assert vlm.model.dtype == torch.float32
    assert PrunedVLM.from_pretrained("tiny:llava", method=None, dtype="bfloat16").model.dtype == torch.bfloat16


def test_qwen_saliency_block_must_be_full_attention():
    model, processor = tiny_vlm("qwen2_5_vl")
    assert PrunedVLM(model, processor, budget=4, saliency_block=1).adapter.block == 1
    assert PrunedVLM(model, processor, budget=4).adapter.block == 3  # default: the last full-attention block
    with pytest.raises(ValueError, match=r"full-attention block of the vision tower \[1, 3\]"):
        PrunedVLM(model, processor, budget=4, saliency_block=0)


def test_qwen3_saliency_block_is_any_vision_block():
    model, processor = tiny_vlm("qwen3_vl")  # 4 blocks, every one attends over the whole image
    assert PrunedVLM(model, processor, budget=4).adapter.block == 3  # default: the last block
    assert PrunedVLM(model, processor, budget=4, saliency_block=0).adapter.block == 0
    with pytest.raises(ValueError, match=r"saliency_block must be a block of the vision tower \(0 \.\. 3\)"):
        PrunedVLM(model, processor, budget=4, saliency_block=4)


@pytest.mark.parametrize("arch, method, budget, options", [
    ("qwen2_5_vl", "promprune", 4, {"saliency_block": 0}),
    ("qwen3_vl", "promprune", 4, {"saliency_block": 99}),
    ("internvl", None, None, {"saliency_block": 99}),
    ("gemma4", "divprune", 4, {"saliency_block": -1}),
    ("llava_next", "promprune", 3, {"budget_mode": "view_quota"}),
    ("qwen2_5_vl", "cdpruner", 4, {"text_source": "clip"}),
    ("llava", "promprune", 4, {"saliency_block": 0}),
    ("llava_next", "vispruner", 4, {"saliency_block": 1}),
    ("llava_onevision", "promprune", 4, {"saliency_block": 0}),
])
def test_what_construction_refuses_is_known_from_the_config_alone(arch, method, budget, options):
    """``vlm.construction_problems`` (what the pipeline's preflight runs, no weights) names the same problem, in the
    same words, as the constructor raises: one piece of code, so the two cannot drift."""
    from promprune.models.registry import family_of
    from promprune.models.vlm import construction_problems

    model, processor = tiny_vlm(arch)
    with pytest.raises(ValueError) as raised:
        PrunedVLM(model, processor, method=method, budget=budget, **options)
    views = family_of(model.config).adapter.views(model.config, processor)
    method_options, adapter_options = validate_method(method, budget, **options)
    problems = construction_problems(model.config, method, budget, method_options, adapter_options, views)
    assert [str(p) for p in problems] == [str(raised.value)]
    assert problems[0].option == ("budget" if "budget_mode" in options else next(iter(options)))
    fine = {k: v for k, v in options.items() if k != "saliency_block"} if "saliency_block" in options else {}
    assert not construction_problems(model.config, method, budget and 8,
                                     *validate_method(method, budget and 8, **fine), views)


@pytest.mark.parametrize("arch, layer", [("llava", -2), ("llava_next", -2), ("llava_onevision", -1)])
def test_llava_families_refuse_a_saliency_block_they_would_ignore(arch, layer):
    """The LLaVA families read saliency at the layer the projector reads (``vision_feature_layer``: -2 on LLaVA-1.5
    and LLaVA-NeXT, -1 on OneVision, docs/methods.md), the paper's protocol; ``saliency_block`` was accepted and
    ignored, so a run measured another layer than it asked for. Refused by name, at construction and (the same
    ``check_options``) in the preflight; unset, the family's layer as before."""
    from promprune.models.options import OptionError

    model, processor = tiny_vlm(arch)
    assert model.config.vision_feature_layer == layer
    with pytest.raises(OptionError) as raised:
        PrunedVLM(model, processor, method="promprune", budget=4, saliency_block=0)
    assert raised.value.option == "saliency_block"
    assert f"saliency_block 0 is not taken by a {arch} model" in str(raised.value)
    assert f"(vision_feature_layer, {layer})" in str(raised.value)
    assert "remove saliency_block" in str(raised.value)
    assert PrunedVLM(model, processor, method="promprune", budget=4, saliency_block=None).adapter is not None


def test_view_counts_read_from_a_processor_are_unknown_without_one():
    """InternVL's and MiniCPM-V's most views are their processor's (tiny MiniCPM-V: 4 slices, not the released 9):
    without one (a factory's model in the preflight) the count is None and view_quota's budget goes unchecked there,
    not refused by the released count."""
    from promprune.models.registry import family_of

    for arch, count in [("minicpmv4_6", 5), ("internvl", 13), ("llava_next", 5)]:
        model, processor = tiny_vlm(arch)
        adapter = family_of(model.config).adapter
        assert adapter.views(model.config, processor) == count
        assert PrunedVLM(model, processor, method=None).adapter.max_views() == count
        assert adapter.views(model.config) == (count if arch == "llava_next" else None)


def test_several_return_sequences_are_refused(images, prompts):
    # one Generation per item: several sequences per prompt would mislabel answers across items
    vlm = PrunedVLM.from_pretrained("tiny:llava", method=None)
    with pytest.raises(ValueError, match="num_return_sequences"):
        vlm.generate(images, prompts, num_beams=2, num_return_sequences=2, max_new_tokens=2)


@pytest.mark.parametrize("arch", ARCHS)
def test_generation_reports_which_kept_tokens_are_salient(arch, images, prompts):
    for method, options in [("fixed_ratio", {"saliency_ratio": 0.5}), ("saliency_only", {}), ("divprune", {})]:
        vlm = PrunedVLM.from_pretrained(f"tiny:{arch}", method=method, budget=8, **options)
        for g in vlm.generate(images, prompts, max_new_tokens=1):
            assert set(g.salient) <= set(g.kept)
            assert len(g.salient) == g.saliency_count
            if method == "saliency_only":
                assert g.salient == g.kept
            if method == "divprune":
                assert g.salient == []


def test_truncated_image_fails_even_when_pil_is_lenient(images, prompts, monkeypatch):
    # lmms-eval switches PIL to lenient decoding process-wide; the adapter must still refuse a cut-off file
    from PIL import ImageFile

    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    buf = io.BytesIO()
    images[0].save(buf, format="PNG")
    vlm = PrunedVLM.from_pretrained("tiny:llava", method="divprune", budget=4)
    with pytest.raises(ValueError, match="image 0 is corrupt or unreadable"):
        vlm.generate([buf.getvalue()[:200], images[1]], prompts)
    assert ImageFile.LOAD_TRUNCATED_IMAGES is True  # restored afterwards


def test_sixteen_bit_and_float_images_are_scaled_not_clipped():
    """PIL's ``convert("RGB")`` clips a 16-bit image at 255 (a 16-bit photo came out nearly all white) and a float one
    in [0, 1] to 0 or 1 (black): ``load_image`` scales them to 8 bits first, by hand-worked values."""
    import numpy as np
    from PIL import Image

    from promprune.models.images import load_image

    ramp = (np.arange(32 * 64).reshape(32, 64) * 30).astype(np.uint16)  # 0 .. 61410
    png = io.BytesIO()
    Image.fromarray(ramp).save(png, format="PNG")  # a 16-bit PNG, as a scanner or a microscope writes it
    for image in (Image.fromarray(ramp), png.getvalue()):
        got = np.asarray(load_image(image, 0))
        assert got.shape == (32, 64, 3) and (got == got[..., :1]).all()
        np.testing.assert_array_equal(got[..., 0], np.round(ramp / 257.0).astype(np.uint8))
    unit = np.linspace(0.0, 1.0, 32 * 64, dtype=np.float32).reshape(32, 64)
    np.testing.assert_array_equal(np.asarray(load_image(Image.fromarray(unit), 0))[..., 0],
                                  np.round(unit.astype(np.float64) * 255).astype(np.uint8))
    assert np.asarray(load_image(Image.new("I", (4, 4), 200), 0)).max() == 200  # 8-bit values in a 32-bit image


def test_files_are_turned_upright_by_exif_and_the_request_path_converts_as_the_library():
    """A JPEG saved sideways with an EXIF rotation reached the model sideways; transformers' ``load_image`` (and
    ``datasets``) turn it upright. The request path (``decode_image``, ``image_to_png``) converts as ``load_image``:
    it clipped a 16-bit image to white and put transparency on black."""
    import numpy as np
    from PIL import Image
    from transformers.image_utils import load_image as hf_load_image

    from promprune.eval.generation import decode_image, image_to_png
    from promprune.models.images import load_image

    pixels = np.random.default_rng(0).integers(0, 256, (30, 60, 3), dtype=np.uint8)
    sideways = Image.fromarray(pixels)
    exif = sideways.getexif()
    exif[0x0112] = 6  # "rotate 90 CW to view"
    jpeg = io.BytesIO()
    sideways.save(jpeg, format="JPEG", exif=exif.tobytes())
    reference = np.asarray(hf_load_image(Image.open(io.BytesIO(jpeg.getvalue()))))
    assert reference.shape == (60, 30, 3)
    np.testing.assert_array_equal(np.asarray(load_image(jpeg.getvalue(), 0)), reference)
    np.testing.assert_array_equal(np.asarray(decode_image(jpeg.getvalue(), "x")), reference)
    ramp = Image.fromarray((np.arange(32 * 64).reshape(32, 64) * 30).astype(np.uint16))
    rgba = Image.fromarray(np.dstack([pixels, np.tile(np.arange(60, dtype=np.uint8) * 4, (30, 1))]), "RGBA")
    for image in (ramp, rgba):
        png = io.BytesIO()
        image.save(png, format="PNG")
        expected = np.asarray(load_image(image, 0))
        for got in (decode_image(png.getvalue(), "x"), decode_image(image, "x"),
                    Image.open(io.BytesIO(image_to_png(image)))):
            np.testing.assert_array_equal(np.asarray(got), expected)
    # the transparency onto white, by a hand-worked pixel: alpha 4 * 59 = 236 of 255 at the last column
    white = np.asarray(load_image(rgba, 0))[0, 59].astype(int)
    np.testing.assert_allclose(white, np.round(pixels[0, 59].astype(float) * 236 / 255 + 255 * 19 / 255), atol=1)
