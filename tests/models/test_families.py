"""The architecture registry: one module per family, registered by a decorator, and nobody else names a family.

Checked on the registry itself (duplicates refused, unknown names answered with did-you-mean and the options) and on
the source: outside ``promprune/models/architectures/`` no module of the library holds a family's name as a string or
imports a transformers VLM class, so a family's facts cannot drift into a second place.
"""
import ast
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers

from promprune.models.adapters import Adapter
from promprune.models.registry import families, family, family_of, register_family
from promprune.models.shapes import shape_spec, shapes
from promprune.models.tiny import archs
from promprune.models.video import video_families

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ROOT / "promprune"
FAMILIES = LIBRARY / "models" / "architectures"
# packages about one particular model, which they build for their own use: the prominence testbed's LLaVA and the
# recipe that trains it (they choose a family, as a sweep spec does; they decide nothing per architecture)
ONE_MODEL = (LIBRARY / "testbed", LIBRARY / "training")


def test_every_family_is_one_module_named_after_it():
    names = families()
    assert names == sorted(p.stem for p in FAMILIES.glob("*.py") if p.stem != "__init__")
    for name in names:
        fam = family(name)
        assert fam.module == f"promprune.models.architectures.{name}"
        assert issubclass(fam.adapter, Adapter)
        assert isinstance(fam.transformers_class(), type) and fam.transformers_class() is getattr(
            transformers, fam.model_class)
        assert 0.0 < fam.default_mu < 1.0


def test_tiny_models_and_shapes_resolve_through_the_registry():
    assert archs() == families()  # every family has a tiny model
    assert {shape_spec(s)["model_type"] for s in shapes()} <= set(families())
    assert set(video_families()) == {n for n in families() if family(n).video}


def test_a_duplicate_name_is_refused():
    before = families()
    with pytest.raises(ValueError, match="model family 'llava' is already registered .*architectures.llava"):
        @register_family("llava", model_class="LlavaForConditionalGeneration", default_mu=0.42)
        class Again(Adapter):
            pass
    assert families() == before and family("llava").adapter.__name__ == "LlavaAdapter"


def test_unknown_names_say_did_you_mean_and_list_the_families():
    with pytest.raises(ValueError, match=r"unknown model family 'lava' \(did you mean 'llava'\?\); registered: .*"
                                         r"llava_next"):
        family("lava")
    with pytest.raises(ValueError, match=r"unsupported model type 'qwen2_5vl' \(did you mean 'qwen2_5_vl'\?\); "
                                         r"supported: .*gemma4"):
        family_of(SimpleNamespace(model_type="qwen2_5vl"))


def _library_files():
    for path in sorted(LIBRARY.rglob("*.py")):
        if FAMILIES in path.parents or any(pkg in path.parents for pkg in ONE_MODEL):
            continue
        yield path


def test_nothing_outside_a_family_module_names_a_family():
    """No string constant equal to a family's name and no import of a transformers ``...ForConditionalGeneration`` class
    anywhere in the library but the families' own modules (and the one-model packages, which pick LLaVA)."""
    names = set(families())
    found = []
    for path in _library_files():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and node.value in names:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.value!r}")
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("transformers"):
                found += [f"{path.relative_to(ROOT)}:{node.lineno} {a.name}" for a in node.names
                          if a.name.endswith("ForConditionalGeneration")]
    assert found == []


def test_the_docs_list_every_family():
    """docs/methods.md's table of families has a row for each (its ``tiny:<name>``)."""
    text = (ROOT / "docs" / "methods.md").read_text()
    assert [name for name in families() if f"`tiny:{name}`" not in text] == []


def test_a_family_whose_factories_build_another_model_type_is_refused():
    """A family's tiny and shape factories must build its own ``model_type``: a model is run by the adapter of its
    config's type, so a family ``t_misnamed`` whose factories build LLaVA's model would silently run LLaVA's adapter."""
    import promprune.models.registry as registry
    from promprune.models import shapes, tiny

    llava = family("llava")

    @register_family("t_misnamed", model_class="LlavaForConditionalGeneration", default_mu=0.42, tiny=llava.tiny,
                     shape=llava.shape)
    class Misnamed(Adapter):
        pass

    try:
        with pytest.raises(ValueError, match=r"model family 't_misnamed''s tiny factory \(.*\) builds a config of "
                                             r"model_type 'llava', so its model would run family 'llava''s adapter"):
            tiny.tiny_vlm("t_misnamed")
        spec = dict(shape_spec("llava_1_5_7b"), model_type="t_misnamed")
        with pytest.raises(ValueError, match=r"'t_misnamed''s shape factory .* model_type 'llava'"):
            shapes._build(spec, 1, 1)
    finally:
        registry._FAMILIES.pop("t_misnamed", None)
        tiny._cached.cache_clear()
    for name in archs():  # every shipped family builds its own type
        assert tiny.tiny_vlm(name)[0].config.model_type == name


def test_a_family_registered_by_a_module_named_otherwise_is_found_by_its_model_type(tmp_path, monkeypatch):
    """``find_family`` imported only the module named after the ``model_type`` and answered None, so ``family_of``
    said "unsupported model type 't_renamed' (did you mean 't_renamed'?); supported: ..., t_renamed" (its error
    listing loads every module). A lookup now falls back to every family module, as ``family`` does."""
    import importlib
    import sys

    import promprune.models.registry as registry
    from promprune.models.registry import find_family

    (tmp_path / "t_other_file.py").write_text(
        "from promprune.models.adapters import Adapter\n"
        "from promprune.models.registry import register_family\n\n\n"
        "@register_family('t_renamed', model_class='LlavaForConditionalGeneration', default_mu=0.42)\n"
        "class Renamed(Adapter):\n"
        "    pass\n")
    package = importlib.import_module(registry.PACKAGE)
    monkeypatch.setattr(package, "__path__", [*package.__path__, str(tmp_path)])
    monkeypatch.setattr(registry, "_LOADED", False)
    try:
        config = SimpleNamespace(model_type="t_renamed")
        assert find_family(config) is not None and find_family(config).module.endswith(".t_other_file")
        assert family_of(config).name == "t_renamed" and family("t_renamed").adapter.__name__ == "Renamed"
    finally:
        registry._FAMILIES.pop("t_renamed", None)
        sys.modules.pop(f"{registry.PACKAGE}.t_other_file", None)


def test_families_stays_callable_after_a_family_module_is_imported():
    """The documented ``promprune.models.families()`` is the function even after a family's module was imported (the
    modules' package had been named ``families``, and importing one of them bound that name to the package)."""
    import importlib

    import promprune.models as pm

    importlib.import_module("promprune.models.architectures.llava")
    pm.family("qwen2_5_vl")
    assert callable(pm.families) and "llava" in pm.families() and pm.families() == families()


def test_a_checkpoint_not_cached_offline_says_so_when_loaded(monkeypatch, tmp_path):
    """`PrunedVLM.from_pretrained` of a hub checkpoint this machine lacks, with HF_HUB_OFFLINE set (lmms-eval's
    `--model promprune` plugin loads this way), is the preflight's one-line message, not transformers' traceback about
    connecting to huggingface.co."""
    from promprune.models import PrunedVLM

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setattr("transformers.utils.hub.HF_HUB_CACHE", str(tmp_path / "empty-cache"), raising=False)
    with pytest.raises(ValueError, match=r"model 'llava-hf/llava-1.5-7b-hf': it is not in the local Hugging Face "
                                         r"cache and HF_HUB_OFFLINE is set; download it once with `hf download "
                                         r"llava-hf/llava-1.5-7b-hf`"):
        PrunedVLM.from_pretrained("llava-hf/llava-1.5-7b-hf", method=None)
    with pytest.raises(ValueError, match="the local path does not exist"):
        PrunedVLM.from_pretrained(str(tmp_path / "no-such-checkpoint"), method=None)


def test_cdpruner_trials_need_their_clip_text_tower_on_this_machine(monkeypatch, tmp_path):
    """A saved LLaVA checkpoint (its config without the tiny models' ``promprune_clip_text``, as a hub checkpoint's)
    with CDPruner trials embeds the question with the released CLIP text tower; offline and not cached, every such
    sample failed while the run exited 0. The preflight names the tower and the trials (a warning for --validate-only,
    refused by a run); trials that embed with the LLM, or a tower this machine has, pass."""
    from pipelines import preflight
    from pipelines import spec as specs
    from promprune.eval.task_checks import NotOnThisMachine
    from promprune.models.tiny import tiny_vlm

    model, processor = tiny_vlm("llava")  # the process's cached model: the attribute is back after the test
    monkeypatch.delattr(model.config, "promprune_clip_text")
    model.save_pretrained(tmp_path / "llava")
    processor.save_pretrained(tmp_path / "llava")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setattr("transformers.utils.hub.HF_HUB_CACHE", str(tmp_path / "empty-cache"), raising=False)

    def problems(**extra):
        raw = {"name": "t", "version": 1, "model": {"pretrained": str(tmp_path / "llava"), **extra.pop("model", {})},
               "tasks": ["easyvqa_yesno"], "baseline": False,
               "grid": {"method": ["cdpruner", "divprune"], "budget": [8, 4], **extra}}
        return preflight.check_clip_text(specs.parse(raw))

    (found,) = problems()
    assert isinstance(found, NotOnThisMachine)
    assert found.startswith("model.options.clip_text: CDPruner's CLIP text tower for trials cdpruner-b8, cdpruner-b4: "
                            "model 'openai/clip-vit-large-patch14-336': it is not in the local Hugging Face cache")
    assert problems(text_source=["llm"]) == []
    assert problems(model={"options": {"clip_text": "tiny"}}) == []


def _siglip_llava(kind: str):
    """A tiny ``kind`` ("llava" / "llava_next") config of the tiny model's text side with a SigLIP vision tower, as
    llava-hf/llava-interleave-qwen-*-hf (model_type llava, vision_config siglip_vision_model, strategy "full")."""
    from transformers import SiglipVisionConfig

    from promprune.models.tiny import tiny_vlm

    config = tiny_vlm(kind)[0].config.to_dict()
    config["vision_config"] = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                                 num_attention_heads=4, image_size=48, patch_size=8).to_dict()
    config["vision_feature_select_strategy"] = "full"
    return transformers.AutoConfig.for_model(**config)


@pytest.mark.parametrize("kind", ["llava", "llava_next"])
def test_a_llava_with_a_siglip_tower_is_refused_from_its_config(kind):
    """The LLaVA adapters rank by the CLS token's attention row and drop token 0 as the CLS; SigLIP has no CLS (its
    sequence is the patches alone), so such a checkpoint's saliency was patch 0's attention row, silently. It is
    refused from the config alone (what preflight reads) and when a model is wrapped."""
    from promprune.models import PrunedVLM
    from promprune.models.tiny import tiny_vlm

    config = _siglip_llava(kind)
    vision = transformers.SiglipVisionModel(config.vision_config).eval()
    side = config.vision_config.image_size // config.vision_config.patch_size
    out = vision(pixel_values=torch.zeros(1, 3, 48, 48))
    assert out.last_hidden_state.shape[1] == side * side  # no CLS position: every token is a patch
    refused = rf"a {kind} checkpoint with a 'siglip_vision_model' vision tower .* no CLS token.* llava_onevision"
    with pytest.raises(ValueError, match=refused):
        family_of(config)
    model = family(kind).transformers_class()(config)
    with pytest.raises(ValueError, match=refused):
        PrunedVLM(model, tiny_vlm(kind)[1], method="vispruner", budget=8)
    family_of(tiny_vlm(kind)[0].config)  # the CLIP tower of the tiny model (and of LLaVA-1.5 / NeXT) is taken


@pytest.mark.parametrize("kind", ["llava", "llava_next"])
def test_a_clip_llava_that_feeds_the_cls_is_refused_from_its_config(kind, tmp_path):
    """vision_feature_select_strategy "full" on a CLIP tower feeds the CLS as one more token per view (the tiny
    LLaVA: 37, not its 36-token capacity and 6 x 6 grid; VisPruner returned index 36, off the grid, and downsample
    failed with a misleading message). Refused from the config (what preflight reads) and when a model is wrapped."""
    from pipelines.preflight import check_model
    from promprune.models import PrunedVLM
    from promprune.models.tiny import tiny_vlm

    model, processor = tiny_vlm(kind)
    config = transformers.AutoConfig.for_model(**(model.config.to_dict()
                                                  | {"vision_feature_select_strategy": "full"}))
    message = f"a {kind} checkpoint with vision_feature_select_strategy 'full' is not supported"
    with pytest.raises(ValueError, match=message):
        family_of(config)
    full = type(model)(config).eval()
    with pytest.raises(ValueError, match=message):
        PrunedVLM(full, processor, method="vispruner", budget=8)
    config.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    (problem,) = check_model(str(tmp_path), {}, {"vispruner-b8": 8})
    assert problem.startswith(f"model.pretrained: model '{tmp_path}': {message}") and "'default'" in problem


def test_each_family_takes_its_own_processor_with_a_chat_template():
    """A processor of another family (a LLaVA model with LLaVA-NeXT's, InternVL's or Gemma 4's; Qwen2.5-VL with
    LLaVA's) made every sample fail deep in the model's code while the run exited 0; so did one without a chat
    template. Both are refused at construction, naming the classes. The class a family takes is transformers' own
    AutoProcessor mapping, the one its tiny model's (hand-built) processor has."""
    import copy

    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    from promprune.models import PrunedVLM
    from promprune.models.tiny import tiny_vlm

    llava, processor = tiny_vlm("llava")
    for other in ("llava_next", "internvl", "gemma4"):
        wrong = type(tiny_vlm(other)[1]).__name__
        with pytest.raises(ValueError, match=f"the processor is of class {wrong}, but a llava model takes its "
                                             "LlavaProcessor"):
            PrunedVLM(llava, tiny_vlm(other)[1], method="promprune", budget=8)
    with pytest.raises(ValueError, match="is of class LlavaProcessor, but a qwen2_5_vl model takes its "
                                         "Qwen2_5_VLProcessor"):
        PrunedVLM(tiny_vlm("qwen2_5_vl")[0], processor, method=None)
    bare = copy.deepcopy(processor)
    bare.chat_template = None
    with pytest.raises(ValueError, match=r"the processor \(LlavaProcessor\) has no chat template"):
        PrunedVLM(llava, bare, method=None)
    PrunedVLM(llava, processor, method="promprune", budget=8)
    for name in families():
        assert family(name).processor_class == type(tiny_vlm(name)[1]).__name__ == PROCESSOR_MAPPING_NAMES[name]


def test_a_checkpoint_directory_without_its_processor_or_with_another_is_refused_before_its_weights(tmp_path):
    """`PrunedVLM.from_pretrained` of a directory saved without processor files, or with another family's, says so
    before any weight is read (transformers' "Can't load image processor" came after the weights loaded)."""
    from promprune.models import PrunedVLM
    from promprune.models.tiny import tiny_vlm

    bare, other = tmp_path / "bare", tmp_path / "other"
    for directory in (bare, other):
        tiny_vlm("llava")[0].config.save_pretrained(directory)  # no weights: refused before they would load
    tiny_vlm("qwen2_5_vl")[1].save_pretrained(other)
    with pytest.raises(ValueError, match=rf"model '{bare}': its processor does not load \(OSError: .*\); save the "
                                         r"processor beside the weights"):
        PrunedVLM.from_pretrained(str(bare), method=None)
    with pytest.raises(ValueError, match=rf"model '{other}': the processor is of class Qwen2_5_VLProcessor, but a "
                                         "llava model takes its LlavaProcessor"):
        PrunedVLM.from_pretrained(str(other), method=None)
