"""lmms-eval's optional `import evaluate` deferred to its first use (`promprune.eval.deferred`).

Each check runs in a fresh interpreter: what a scoring process imports is the point.
"""
import subprocess
import sys
import textwrap


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip()


def test_scoring_imports_leave_evaluate_and_transformers_pipelines_unimported():
    got = _run("""
        import sys
        import promprune.eval.scoring, lmms_eval.api.model, lmms_eval.evaluator, lmms_eval.api.registry
        from promprune.eval import deferred
        print(deferred.is_deferred("evaluate"), "transformers.pipelines" in sys.modules)
    """)
    assert got == "True False"


def test_the_first_use_gives_the_real_module_to_every_holder():
    """Plain `import evaluate` after the deferral, and lmms-eval's own reference, both reach the real `load`."""
    got = _run("""
        import sys
        import promprune.eval, lmms_eval.api.registry as registry
        import evaluate
        load = evaluate.load  # the first read: the real import happens here
        from promprune.eval import deferred
        import importlib
        real = sys.modules["evaluate"]
        print(deferred.is_deferred("evaluate"), load.__module__, registry.hf_evaluate.load is load,
              real.load is load, importlib.import_module("evaluate.loading").load is load)
    """)
    assert got == "False evaluate.loading True True True"


def test_inspect_and_hasattr_over_sys_modules_do_not_load_it():
    """`inspect.getmodule` probes every module's `__file__` (torch's op registration calls it at import)."""
    got = _run("""
        import inspect, sys
        import promprune.eval
        from promprune.eval import deferred
        inspect.getmodule(inspect.currentframe())
        print(deferred.is_deferred("evaluate"), hasattr(sys.modules["evaluate"], "__wrapped__"))
    """)
    assert got == "True False"
