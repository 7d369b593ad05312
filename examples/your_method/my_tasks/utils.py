"""Prompt and score of my_exist_medium (lmms-eval imports this file by path for the YAML's `!function utils.*`)."""


def doc_to_visual(doc):
    return [doc["image"].convert("RGB")]


def doc_to_text(doc, lmms_eval_specific_kwargs=None):
    return doc["question"] + (lmms_eval_specific_kwargs or {}).get("post_prompt", "")


def process_results(doc, results):
    """1.0 when the answer's first word is the right yes / no."""
    words = str(results[0]).strip().lower().split()
    first = words[0].strip(".,!") if words else ""
    return {"accuracy": float(first == doc["answer"])}
