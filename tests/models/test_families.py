"""The architecture registry: one module per family, registered by a decorator, and nobody else names a family.

Checked on the registry itself (duplicates refused, unknown names answered with did-you-mean and the options) and on
the source: outside ``promprune/models/architectures/`` no module of the library holds a family's name as a string or
imports a transformers VLM class, so a family's facts cannot drift into a second place.
"""
import ast
from pathlib import Path
from types import SimpleNamespace

import pytest
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

