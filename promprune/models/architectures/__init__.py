"""One module per VLM family, each registering itself with :func:`promprune.models.registry.register_family`.

A family module holds everything promprune knows about its architecture: the adapter (how an image becomes candidate
tokens with saliency, how the kept tokens reach the LLM, and clips where it handles them), the tiny model
(``tiny:<name>``) and the shape factory (``shape:<checkpoint>``, with the sizes in ``promprune/models/shapes``), the
default ``mu``, the most visual tokens and views one image gives, and whether the LLM keeps 3D M-RoPE positions. The
module ``<name>.py`` registers the family ``<name>`` (its checkpoints' ``model_type``); the registry imports it when the
family is first looked up (every module when the families are listed), so adding a family is adding a module (its tests
beside the others' in ``tests/models``, a row in ``docs/methods.md``); nothing else names it.
"""
