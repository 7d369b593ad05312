"""The experiment pipeline: sweep specs, warm model workers on an elastic Ray cluster, Ray Tune sweeps, MLflow tracking.

Entry scripts (run from the repository root):

    python pipelines/sweep.py [--config sweeps/<spec>.yaml] [--set key=value ...] [--resume]
    python pipelines/evaluate.py --model tiny:llava --method promprune --budget 16 --tasks easyvqa_yesno

Ray and MLflow live here and only here; the `promprune` library never imports this package.
"""

import os as _os
import sys as _sys

# `python pipelines/sweep.py` puts this directory first on sys.path, where its modules would shadow top-level packages
# of the same name for every later import: lmms-eval's `import evaluate` (Hugging Face's) got `pipelines/evaluate.py`.
# Our modules are imported as `pipelines.<name>`; the bare directory entry goes.
_HERE = _os.path.dirname(_os.path.abspath(__file__))
_sys.path[:] = [p for p in _sys.path if _os.path.abspath(p or _os.curdir) != _HERE]
