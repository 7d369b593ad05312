"""The experiment pipeline: sweep specs, warm model workers on an elastic Ray cluster, Ray Tune sweeps, MLflow tracking.

Entry scripts (run from the repository root):

    python pipelines/sweep.py [--config sweeps/<spec>.yaml] [--set key=value ...] [--resume]
    python pipelines/evaluate.py --model tiny:llava --method promprune --budget 16 --tasks easyvqa_yesno

Ray and MLflow live here and only here; the `promprune` library never imports this package.
"""
