"""scripts/device_wheels.py: the wheels that carry the pipeline to the GPU machine (stripped, batched, checked).

Synthetic wheels only (no download): stripping keeps a wheel pip installs (RECORD rewritten, the executable bit
kept), the batcher's first-fit-decreasing split is the hand-worked one, the requirement walk follows markers and
extras as pip would on CPython 3.12 Linux, and the project's metadata-only dist-info carries its entry points.
"""
from __future__ import annotations

import base64
import hashlib
import importlib.util
import stat
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("device_wheels", REPO / "scripts" / "device_wheels.py")
dw = sys.modules.setdefault("device_wheels", importlib.util.module_from_spec(spec))
spec.loader.exec_module(dw)


def _hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def make_wheel(folder: Path, files: dict[str, bytes], executable: tuple[str, ...] = ()) -> Path:
    """A valid pure wheel `toy-1.0` holding `files`, with METADATA, WHEEL and a RECORD of every file."""
    info = "toy-1.0.dist-info"
    files = {**files, f"{info}/METADATA": b"Metadata-Version: 2.1\nName: toy\nVersion: 1.0\n",
             f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{name},{_hash(data)},{len(data)}\n" for name, data in files.items()) + f"{info}/RECORD,,\n"
    path = folder / "toy-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in {**files, f"{info}/RECORD": record.encode()}.items():
            zi = zipfile.ZipInfo(name)
            zi.external_attr = ((0o755 if name in executable else 0o644) | stat.S_IFREG) << 16
            zi.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(zi, data)
    return path


def test_strip_drops_the_files_and_their_record_lines_and_pip_installs_the_rest(tmp_path):
    src_dir, out_dir = tmp_path / "src", tmp_path / "out"
    src_dir.mkdir(), out_dir.mkdir()
    src = make_wheel(src_dir, {"toy/__init__.py": b"X = 1\n", "toy/jars/big.jar": b"\0" * 5000,
                               "toy/jars/more/other.jar": b"j", "toy/bin/tool": b"#!/bin/sh\necho hi\n",
                               "toy/data/keep.jar.txt": b"not a jar dir"}, executable=("toy/bin/tool",))
    dst = out_dir / src.name
    assert dw.strip_wheel(src, dst, ("toy/jars/*",)) == 2
    with zipfile.ZipFile(dst) as zf:
        names = set(zf.namelist())
        record = zf.read("toy-1.0.dist-info/RECORD").decode().splitlines()
        # every RECORD line but its own names a file in the wheel with that file's hash and size
        listed = {}
        for line in record:
            name, digest, size = line.split(",")
            listed[name] = (digest, size)
            if name != "toy-1.0.dist-info/RECORD":
                data = zf.read(name)
                assert (digest, size) == (_hash(data), str(len(data)))
        assert set(listed) == names
        assert not any(n.startswith("toy/jars/") for n in names)
        assert (zf.getinfo("toy/bin/tool").external_attr >> 16) & 0o111
    target = tmp_path / "site"
    run = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                          "--target", str(target), str(dst)], capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stderr
    assert (target / "toy" / "__init__.py").read_text() == "X = 1\n"
    assert (target / "toy" / "data" / "keep.jar.txt").exists() and not (target / "toy" / "jars").exists()
    assert (target / "toy" / "bin" / "tool").stat().st_mode & stat.S_IXUSR


def test_pack_is_first_fit_decreasing_with_the_first_files_in_batch_one():
    sizes = {"a": 50, "b": 40, "c": 30, "d": 20, "e": 10}
    # decreasing: a -> 1; b -> 2; c -> 3; d fits 2 (40+20); e fits 1 (50+10)
    assert dw.pack(sizes, 60) == [["a", "e"], ["b", "d"], ["c"]]
    # c first in batch 1; a, b open batches 2 and 3; d and e fill batch 1 (30+20+10)
    assert dw.pack(sizes, 60, first=("c",)) == [["c", "d", "e"], ["a"], ["b"]]
    with pytest.raises(ValueError, match="a \\(0.0 MiB\\)"):
        dw.pack(sizes, 45)


def test_walk_follows_markers_and_requested_extras_and_flags_old_versions(monkeypatch):
    monkeypatch.setattr(dw, "LEAVE", {"big": "not imported"})
    dists = {
        "app": dw.Dist("1.0", ["lib[fast]>=2", "tool; extra == 'cli'", "old; python_version < '3.12'",
                               "linuxonly; sys_platform == 'linux'", "big"], "wheel"),
        "lib": dw.Dist("2.1", ["speedup; extra == 'fast'", "slowdown; extra == 'slow'", "img>=3"], "wheel"),
        "speedup": dw.Dist("0.1", [], "wheel"), "linuxonly": dw.Dist("1", [], "wheel"),
        "img": dw.Dist("2.0", None, "image"),  # an image package whose version is too old
    }
    w = dw.walk([Requirement("app")], dists.get)
    assert set(w.needed) == {"app", "lib", "speedup", "linuxonly", "img"}
    assert w.needed["lib"] == {"fast"}
    assert w.unmet == [("img>=3", "lib==2.1[fast]", "2.0")]
    assert w.left == [("big", "app==1.0")] and w.missing == []
    # asking for the extra later follows its requirements too
    w = dw.walk([Requirement("app"), Requirement("lib[slow]")], dists.get)
    assert w.missing == [('slowdown; extra == "slow"', "lib==2.1[slow]")] and w.needed["lib"] == {"fast", "slow"}


def test_project_roots_expand_the_self_referencing_extras():
    roots = {dw.name_of(r.name) for r in dw.project_roots(REPO / "pyproject.toml")}
    assert {"torch", "transformers", "ray", "mlflow", "lmms-eval", "easy-vqa", "scikit-image"} <= roots
    assert "promprune" not in roots and "pytest" not in roots  # dev is not asked for


def test_dist_info_gives_importlib_the_projects_entry_points(tmp_path):
    dw.main(["dist-info", "--target", str(tmp_path / "meta")])
    (dist,) = [d for d in metadata.distributions(path=[str(tmp_path / "meta")])]
    assert dist.metadata["Name"] == "promprune"
    eps = {(ep.group, ep.name): ep.value for ep in dist.entry_points}
    assert eps[("lmms_eval.models", "promprune")] == "promprune.eval.lmms_plugin:MANIFEST"
    assert eps[("promprune.model_factories", "testbed")] == "promprune.testbed.zoo:load"


def test_the_image_list_and_constraints_parse(tmp_path):
    image = dw.read_image(REPO / "scripts" / "device_image.txt")
    pins = dw.read_pins(REPO / "constraints.txt")
    assert image["torch"] == "2.11.0" and image["huggingface-hub"] == "1.33.0" and image["pandas"] == "3.0.6"
    assert pins["ray"] == "2.60.0" and pins["lmms-eval"] == "0.7.3"
    listed = tmp_path / "image.txt"
    listed.write_text("# a comment\npandas\nTorch==2.11.0\n")
    assert dw.read_image(listed) == {"pandas": None, "torch": "2.11.0"}  # a bare name: its version unknown


def _dist_info(folder: Path, name: str, version: str, requires: tuple[str, ...] = ()) -> metadata.Distribution:
    info = folder / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}",
             *(f"Requires-Dist: {r}" for r in requires)]
    (info / "METADATA").write_text("\n".join(lines) + "\n")
    return metadata.PathDistribution(info)


def test_shadow_conflicts_name_image_packages_broken_by_a_carried_copy_but_not_carried_ones(tmp_path):
    site, image = tmp_path / "site", tmp_path / "image"
    dists = [
        # the image's pydantic pins its own core; the batches carry an older pair: the image's pydantic is
        # shadowed too, so the pair the batches bring is what imports (the false alarm of 2026-11-25)
        _dist_info(image, "pydantic", "2.14.4", ("pydantic-core==2.50.5",)),
        _dist_info(image, "pydantic-core", "2.50.5"),
        _dist_info(site, "pydantic", "2.14.3", ("pydantic-core==2.50.4",)),
        _dist_info(site, "pydantic-core", "2.50.4"),
        # an image package the batches do not carry, needing more than the carried filelock: a real conflict
        _dist_info(image, "hubby", "1.0", ("filelock>=4.3", "other>=1")),
        _dist_info(site, "filelock", "4.2.11"),
    ]

    def carried(dist):
        return site in Path(str(dist._path)).parents

    assert dw.shadow_conflicts(dists, carried) == [
        "SHADOWED hubby 1.0 (image) requires filelock>=4.3; the batches' filelock 4.2.11 comes first on sys.path"]


def test_every_carried_image_package_is_pinned_and_meets_the_projects_own_requirement():
    image = dw.read_image(REPO / "scripts" / "device_image.txt")
    pins = dw.read_pins(REPO / "constraints.txt")
    own = {dw.name_of(r.name): r for r in dw.project_roots(REPO / "pyproject.toml")}
    for name in dw.CARRY:
        assert name in image, f"{name} is not an image package: nothing to carry it past"
        assert name in pins, f"constraints.txt pins no {name}: the build cannot download it"
        if name in own:
            assert own[name].specifier.contains(pins[name]), (name, str(own[name]), pins[name])


def test_benchmark_subprocesses_keep_the_batches_on_their_path(monkeypatch, tmp_path):
    """The benchmarks' child processes (the shell loop of sweep_scaling, engine_designs, throughput) put the checkout
    first and keep what this process was given: on the GPU machine that is where Ray, MLflow and lmms-eval live."""
    from benchmarks import pythonpath

    batch = tmp_path / ".site" / "whl2"
    monkeypatch.setenv("PYTHONPATH", f"{REPO}:{batch}")
    assert pythonpath(REPO).split(":") == [str(REPO), str(batch)]
    monkeypatch.delenv("PYTHONPATH")
    assert pythonpath(REPO) == str(REPO)
    # and a child started that way imports what only the given path holds
    (batch / "only_in_the_batch.py").parent.mkdir(parents=True)
    (batch / "only_in_the_batch.py").write_text("VALUE = 7\n")
    monkeypatch.setenv("PYTHONPATH", str(batch))
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": pythonpath(REPO)}
    out = subprocess.run([sys.executable, "-c", "import only_in_the_batch, benchmarks; print(only_in_the_batch.VALUE)"],
                         env=env, capture_output=True, text=True, check=True, cwd=tmp_path)
    assert out.stdout.strip() == "7"


def test_pin_image_sets_the_machines_versions_keeps_comments_and_adds_the_rest(tmp_path):
    image = tmp_path / "device_image.txt"
    image.write_text("# the image\nfilelock\ntorch==2.11.0\n\n# more\npandas\n")
    freeze = tmp_path / "image-freeze.txt"
    freeze.write_text("filelock==4.3.1\ntorch==2.11.0\nPandas==3.0.1\npydantic==2.14.4\n"
                      "promprune @ file:///work\n")
    assert dw.main(["pin-image", str(freeze), "--image", str(image)]) == 0
    assert image.read_text().splitlines() == [
        "# the image", "filelock==4.3.1", "torch==2.11.0", "", "# more", "pandas==3.0.1",
        "# on the lent machine (its pip freeze) but not in its device notes; added by `device_wheels.py pin-image`",
        "pydantic==2.14.4"]
    # read back as the build reads it: filelock's known 4.3.1 now fails pyproject's <4.3, so the build carries it
    # even without the CARRY table
    assert dw.read_image(image)["filelock"] == "4.3.1"
    # a second run with the same freeze changes nothing
    before = image.read_text()
    dw.main(["pin-image", str(freeze), "--image", str(image)])
    assert image.read_text() == before
    freeze.write_text("nothing useful\n")
    with pytest.raises(SystemExit, match="no NAME==VERSION lines"):
        dw.main(["pin-image", str(freeze), "--image", str(image)])
