"""An in-LLM pruning method of your own, from outside promprune: at layer K, keep the visual tokens whose hidden
states have the largest norm.

An in-LLM method is one score function, ``score(inputs, **options) -> [B, L]``, registered under a name with the
layers it cuts before; importing this file registers it. Before each of those layers promprune's hooks call it once
for the batch with what the layer's pre-hook has (``inputs.hidden [B, L, D]``: the layer's input hidden states;
``inputs.visual [B, L]``: the visual tokens still in the sequence; ``inputs.attention()`` / ``inputs.key_norms()``:
the layer's own last-token attention and key norms, on demand) and keep each row's top-scored visual tokens, with
the masks, positions, KV cache and batching of FastV's and PyramidDrop's hooks. A sweep imports it with
``plugins: [hidden_norm.py]``; its trials take option ``layers`` (absolute layers) besides ``p``.
"""
import promprune


def _check(options: dict, budget: int | None = None) -> None:
    if options["p"] < 1:
        raise ValueError(f"option 'p' of hidden_norm must be >= 1 (a norm), got {options['p']!r}")


def hidden_norm(inputs, *, p: float):
    """Keep the visual tokens of largest hidden-state L-p norm at the layer."""
    return inputs.hidden.float().norm(p=p, dim=-1)  # [B, L]: a score per column; the visual ones are ranked


# layers=(2,): FastV's K = 2 of a 32-layer LLM, scaled to the model's depth (K = 1 on the testbed's 4 layers)
promprune.register_in_llm_method("hidden_norm", score=hidden_norm, layers=(2,), options={"p": 2.0}, check=_check)
