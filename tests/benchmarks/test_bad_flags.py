"""Every script in benchmarks/ refuses a user's mistake on its command line as the pipelines' entry points do
(`benchmarks.Flags`, `pipelines.frontdoor.refuse`): exit 2, one message that names each bad flag and its fix, no
traceback, and nothing of the script's work done first (its stdout empty). Each case runs the script as RESULTS.md
runs it (``python benchmarks/<script>``, a fresh interpreter), as the smoke tests do; a mistake's message is checked
by the flag and value it names.

A case lists several mistakes at once where the script checks them together: each must be named."""
from __future__ import annotations

import re

import pytest
import torch

from tests.benchmarks.helpers import REPO, refused

# script -> (arguments, what stderr must say: the flags with their values, and a hint of each fix)
CASES = {
    "efficiency.py": (["--methods", "nosuch", "--budgets", "none,0,500", "--batch", "0", "--dtype", "fp17",
                       "--repeats", "0"],
                      ["--methods nosuch: unknown method 'nosuch'", "--budgets 0: must be at least 1",
                       "--budgets 500: tiny:llava_next gives an image at most 80 visual tokens",
                       "--batch 0: must be at least 1", "--dtype fp17: unknown dtype 'fp17' (did you mean 'fp16'?)",
                       "--repeats 0: must be at least 1"]),
    "video.py": (["--frames", "0", "--repeats", "0", "--width-divisor", "3"],
                 ["--frames 0: must be at least 1", "--repeats 0: must be at least 1",
                  "--width-divisor 3: llava_onevision_7b: width_divisor 3 does not divide"]),
    "models.py": (["--model", "tiny:nosuch", "--methods", "fastv", "nosuch", "--repeats", "0", "--image-size", "0"],
                  ["--model tiny:nosuch: unknown model family 'nosuch'", "--methods nosuch: unknown method",
                   "--repeats 0: must be at least 1", "--image-size 0: must be at least 1"]),
    "profile_select.py": (["--method", "promprun", "--budget", "0", "--dtype", "float17", "--rows", "0"],
                          ["--method promprun: unknown method 'promprun' (did you mean 'promprune'?)",
                           "--budget 0: must be at least 1", "--dtype float17: unknown dtype",
                           "--rows 0: must be at least 1"]),
    "model_path.py": (["--methods", "nosuch", "--models", "nosuch:llava", "--batch", "0"],
                      ["--methods nosuch: unknown method", "--models nosuch:llava: unknown model factory 'nosuch'",
                       "--batch 0: must be at least 1"]),
    "launches.py": (["--method", "nosuch", "--shape", "1x576", "--budget", "0"],
                    ["--method nosuch: unknown method", "--shape 1x576: expected BxNxd",
                     "--budget 0: must be at least 1"]),
    "selection.py": (["--smoke", "--tables", "timing,nosuch", "--batch", "0", "--threads", "0", "--stream-images", "0",
                      "--stream-check", "-1"],
                     ["--tables nosuch: unknown table 'nosuch'", "--batch 0: must be at least 1",
                      "--threads 0: must be at least 1", "--stream-images 0: must be at least 1",
                      "--stream-check -1: must be at least 0"]),
    "spectrum.py": (["--repeats", "0", "--device", "tpu"],
                    ["--repeats 0: must be at least 1", "--device tpu: not a device this benchmark runs on"]),
    "vispruner_tiles.py": (["--chain", "--sizes", "544-32,16:64", "--batch", "0"],
                           ["--sizes 544-32: expected CANDIDATES:KEPT", "--sizes 16:64: expected CANDIDATES:KEPT",
                            "--batch 0: expected views per call"]),
    "random_fingerprint.py": (["--sets", "0", "--dim", "-1"],
                              ["--sets 0: must be at least 1", "--dim -1: must be at least 1"]),
    "tf32_picks.py": (["--seeds", "0"], ["--seeds 0: must be at least 1"]),
    "alike_tokens.py": (["--ranks", "20", "0"], ["--ranks 0: must be at least 1"]),
    "frontdoor.py": (["--runs", "0"], ["--runs 0: must be at least 1"]),
    "block_overhead.py": (["--smoke", "--checkout", "/nonexistent/promprune-checkout"],
                          ["--checkout /nonexistent/promprune-checkout: no such directory"]),
    "engine_designs.py": (["--designs", "pool", "nosuch", "--trials", "9"],
                          ["--designs nosuch: unknown design 'nosuch'", "--trials 9: at most 7"]),
    "model_loading.py": (["--actors", "0", "--layers", "1", "--hidden", "65"],
                         ["--actors 0: must be at least 1", "--hidden 65:"]),
    "decision_margins.py": (["--limit", "0", "--calibration-n", "0"],
                            ["--limit 0: must be at least 1", "--calibration-n 0: must be at least 1"]),
    "margin_by_size.py": (["--sizes", "576,1", "--seeds", "0", "--device", "tpu"],
                          ["--sizes 1: must be at least 2", "--seeds 0: must be at least 1",
                           "--device tpu: not a device this benchmark runs on"]),
    "view_shares.py": (["--repeats", "0", "--batch", "1", "0", "--shapes", "llava-nxt,ov-video-8", "--device", "tpu",
                        "--dtype", "fp17", "--detail", "-1"],
                       ["--repeats 0: must be at least 1", "--batch 0: must be at least 1",
                        "--shapes llava-nxt: unknown shape 'llava-nxt' (did you mean 'llava-next'?)",
                        "--device tpu: not a device this benchmark runs on", "--dtype fp17: unknown dtype",
                        "--detail -1: must be at least 0"]),
    "prefix_agreement.py": (["--limit", "1", "--dtypes", "float32", "fp17", "--batch-size", "0"],
                            ["--dtypes fp17: unknown dtype", "--batch-size 0: must be at least 1"]),
    "request_bytes.py": (["--tasks", "nosuch", "--limit", "4"], ["--tasks: unknown lmms-eval task(s) ['nosuch']"]),
    "sweep_cost.py": (["--spec", "sweeps/table1_llava15.yaml", "--set", "tasks=[easyvqa_yesno]"],
                      ["--spec sweeps/table1_llava15.yaml: its tasks easyvqa_yesno have no published size"]),
    "throughput.py": (["--smoke", "--workdir", "README.md", "--threads", "0"],
                      ["--workdir README.md: is a file", "--threads 0: must be at least 1"]),
}


def test_every_script_has_a_case():
    """A new script in benchmarks/ needs its bad command line here, as it needs its smoke test (sweep_scaling.py and
    lanczos_steps.py have theirs below; entropy_routes.py takes only ``--smoke``)."""
    scripts = {p.name for p in (REPO / "benchmarks").glob("*.py") if '__name__ == "__main__"' in p.read_text()}
    assert scripts == set(CASES) | {"sweep_scaling.py", "lanczos_steps.py", "entropy_routes.py"}


@pytest.mark.parametrize("script", sorted(CASES))
def test_a_bad_command_line_is_refused(script):
    args, says = CASES[script]
    err = refused(script, *args)
    assert err.startswith(f"error: benchmarks/{script}: "), err
    for words in says:
        assert words in err, f"{words!r} not in:\n{err}"


def test_decision_margins_refuses_methods_it_does_not_replay():
    """A spec whose trials run a method (or PromPrune options) the script does not replay is refused before the
    model loads, naming the trial; a spec that does not load, with its SpecError's paragraph."""
    err = refused("decision_margins.py", "--spec", "sweeps/testbed_methods.yaml")
    assert "--spec sweeps/testbed_methods.yaml: trial visionzip-b16 runs visionzip, whose decisions this script " \
           "does not replay" in err, err
    err = refused("decision_margins.py", "--spec", "nosuch.yaml")
    assert err.startswith("error: ") and "nosuch.yaml" in err, err


def test_sweep_scaling_refuses_before_ray(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    err = refused("sweep_scaling.py", "--smoke", "--gpus", "0", "2", "--batch-size", "0", "--timeline",
                  str(blocker / "events.json"))
    for words in ("--gpus 0: must be at least 1", "--batch-size 0: must be at least 1",
                  f"--timeline {blocker / 'events.json'}: {blocker} is not a directory"):
        assert words in err, f"{words!r} not in:\n{err}"


@pytest.mark.parametrize("budgets", [None, "none,64"])
def test_efficiency_checks_the_analytic_shapes_capacity(budgets):
    """A probe's case: MiniCPM-V 4.6's visual-token count depends on the image (no capacity), so its unpruned
    analytic row had no count and the script crashed with a TypeError; a budget above Gemma 4 31B's capacity (280)
    printed a row of tokens the model never receives. Both refused; counts alone print (the smoke test's rows)."""
    extra = [] if budgets is None else ["--budgets", budgets]
    err = refused("efficiency.py", "--skip-measured", "--analytic-shape", "minicpm_v_4_6", *extra)
    assert "--budgets none: --analytic-shape minicpm_v_4_6's visual-token count depends on the image" in err, err
    assert "give --budgets as counts only" in err, err
    err = refused("efficiency.py", "--skip-measured", "--analytic-shape", "gemma4_31b", "--budgets", "none,300,62")
    assert "--budgets 300: --analytic-shape gemma4_31b gives an image at most 280 visual tokens" in err, err


def test_lanczos_steps_refuses_the_cpu_without_the_interpreter():
    """On the CPU the kernels need Triton's interpreter: said with the fix, exit 2, as any other mistake."""
    err = refused("lanczos_steps.py", "--device", "cpu", "--shapes", "1x40", "2by70", "--blocks", "48",
                  unset=("TRITON_INTERPRET",))
    for words in ("--device cpu: on the CPU the kernels run only in Triton's interpreter: set TRITON_INTERPRET=1",
                  "--shapes 2by70: expected VIEWSxTOKENS", "--blocks 48: a block edge is a power of two"):
        assert words in err, f"{words!r} not in:\n{err}"


def test_an_unwritable_output_directory_is_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        if (locked / "probe").exists() or _writable(locked):
            pytest.skip("this user writes in a read-only directory (root)")
        err = refused("throughput.py", "--smoke", "--workdir", str(locked / "work"))
    finally:
        locked.chmod(0o700)
    assert f"--workdir {locked / 'work'}: cannot write in {locked} (permission denied)" in err, err


def _writable(folder) -> bool:
    try:
        (folder / "probe").write_text("")
    except OSError:
        return False
    return True


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
@pytest.mark.parametrize("script", ["efficiency.py", "video.py", "profile_select.py", "selection.py", "spectrum.py",
                                    "prefix_agreement.py"])
def test_cuda_on_a_machine_without_one(script):
    """``--device cuda`` where torch sees no GPU: refused with the fix, before a model or tensor is made there."""
    args = ["--device", "cuda"] + (["--smoke"] if script in ("selection.py", "spectrum.py") else [])
    err = refused(script, *args)
    assert re.search(r"--device cuda: this machine has no CUDA GPU that torch can use", err), err
