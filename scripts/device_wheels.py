"""Carry the pipeline to the lent GPU machine: the wheels its image lacks, in batches that fit one call's transfer.

The machine (Python 3.12, torch 2.11 CUDA 13, no network) has torch and transformers 5.17 but no Ray, MLflow or
lmms-eval; one call sends at most 64 MiB. Here (with PyPI):

    python scripts/device_wheels.py build      # closure -> .whl-cache/, Ray without ray/jars/, batches .whl1, .whl2...
    python scripts/device_wheels.py check      # every requirement of the closure met by the batches + the image list

There (`scripts/gpu_checklist.sh` calls these):

    python3 scripts/device_wheels.py dist-info --target .site/promprune    # this project's entry points, no code
    python3 scripts/device_wheels.py check-installed                       # the same check on the real versions

Back here, with the image-freeze.txt that call 1 brings back:

    python scripts/device_wheels.py pin-image gpu-logs/image-freeze.txt    # the image list's versions, as they are

The closure starts at pyproject.toml's dependencies with the `pipeline` extra (which includes `eval`), follows each
wheel's Requires-Dist (markers evaluated for CPython 3.12 on x86-64 Linux, extras only where requested), and stops at
packages the image has (scripts/device_image.txt), unless the image's known version fails a requirement (then that
package travels too: transformers, 5.17 there, >= 5.23 here). Versions come from constraints.txt. Every batch
installs into its own folder (`pip --target` replaces a top-level folder that exists already, which would drop half
of a namespace package such as `opentelemetry/` split over two batches).
"""
from __future__ import annotations

import argparse
import base64
import csv
import fnmatch
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from dataclasses import dataclass, field
from email.parser import HeaderParser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

REPO = Path(__file__).resolve().parent.parent
MIB = 2**20
BATCH_LIMIT = 60 * MIB  # one call sends 64 MiB; the tracked tree (~2 MiB) travels beside the batch
# pyproject extras the device needs: pipeline (includes eval)
EXTRAS = ("pipeline",)
# files dropped from a wheel (fnmatch patterns; RECORD follows): Java parts nothing on the machine runs
STRIP = {"ray": ("ray/jars/*",),  # Ray's Java workers: Ray's wheel 79 -> 47 MB
         # METEOR / SPICE / the PTB tokenizer call `java` (captioning metrics; none of our tasks): 104 -> 0.1 MB
         "pycocoevalcap": ("pycocoevalcap/*.jar", "pycocoevalcap/meteor/data/*"),
         # the MLflow UI's web app (`mlflow ui`): nothing opens a browser there; the store and reports need none
         "mlflow": ("mlflow/server/js/build/*",)}
# required by lmms-eval's metadata but never imported by the pipeline, its tests or `lmms-eval --model promprune`
# (checked: an import watcher over tests/eval/test_end_to_end.py and a sweep test saw only availability probes of
# wandb: accelerate's is_wandb_available and Ray Tune's optional W&B callback); leaving them halves the transfer
# (4 batches -> 2)
LEAVE = {"wandb": "W&B logging (lmms-eval --wandb_args), 24 MB", "av": "video decoding (video tasks), 38 MB",
         "ruff": "a linter lmms-eval lists as a dependency, 10 MB", "pre-commit": "a git-hook tool, with virtualenv",
         "yt-dlp": "video download (video tasks)", "hf-transfer": "faster hub downloads; the machine has no network",
         # Ray's `default` extra: a pip runtime_env imports virtualenv, the dashboard's profiling button runs py-spy
         "virtualenv": "Ray's pip runtime_env only (no network there), 5.5 MB",
         "py-spy": "the Ray dashboard's profiler, 2.9 MB"}
# image packages that travel anyway: their version there is unknown here, a requirement caps it, and a newer release
# is known to break something we run (each wheel well under 1 MiB). A device-like virtualenv (the image's list
# installed from PyPI on 2026-11-25) resolved filelock to 4.3.1, and lmms-eval's evaluator failed there.
CARRY = {"filelock": "4.3 removed filelock._api, which lmms-eval 0.7.3's evaluator imports (pyproject: <4.3)"}
FIRST = ("transformers",)  # batch 1: what call 1's GPU stages need (parity, selection, table6)
REQUIREMENTS_FILE = "REQUIREMENTS.json"  # in batch 1: the closure's requirements on image packages
PY = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux", "platform_system": "Linux",
      "platform_machine": "x86_64", "os_name": "posix", "implementation_name": "cpython",
      "platform_python_implementation": "CPython", "platform_release": "", "implementation_version": "3.12.3"}
# pip matches manylinux_2_N exactly, so name every N the machine's glibc (2.39, Ubuntu 24.04) runs
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in range(39, 4, -1)] + [
    "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]


def name_of(text: str) -> str:
    return canonicalize_name(text)


# ---------------------------------------------------------------------------------------------------- inputs

def read_pins(path: Path) -> dict[str, str]:
    """constraints.txt -> {canonical name: version}."""
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier  # every line is NAME==VERSION
            pins[name_of(req.name)] = spec.version
    return pins


def list_entry(line: str) -> tuple[str, str | None] | None:
    """One line of a package list (scripts/device_image.txt, a `pip freeze`): (name as written, version or None),
    or None for a blank or comment line."""
    text = line.split("#", 1)[0].strip()
    if not text:
        return None
    name, _, version = text.partition("==")
    return name, version or None


def read_image(path: Path) -> dict[str, str | None]:
    """scripts/device_image.txt -> {canonical name: version, or None where unknown here}."""
    entries = filter(None, map(list_entry, path.read_text().splitlines()))
    return {name_of(name): version for name, version in entries}


def project_roots(pyproject: Path, extras=EXTRAS) -> list[Requirement]:
    """This project's requirements with `extras` (those of EXTRAS that pyproject.toml defines; others named are an
    error), its self-references (`promprune[eval]`) expanded."""
    project = tomllib.loads(pyproject.read_text())["project"]
    own, optional = name_of(project["name"]), project.get("optional-dependencies", {})
    if extras is EXTRAS:
        extras = [e for e in EXTRAS if e in optional]
    roots, todo, seen = [], list(extras), set()
    for text in project["dependencies"]:
        roots.append(Requirement(text))
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        if extra not in optional:
            raise SystemExit(f"pyproject.toml has no extra {extra!r}; it has {', '.join(optional)}")
        for text in optional[extra]:
            req = Requirement(text)
            if name_of(req.name) == own:
                todo.extend(req.extras)
            else:
                roots.append(req)
    return roots


def applies(req: Requirement, extras: set[str]) -> bool:
    """Whether `req` is needed on the machine when its parent was asked for with `extras`."""
    if req.marker is None:
        return True
    return any(req.marker.evaluate({**PY, "extra": extra}) for extra in ({""} | set(extras)))


def wheel_metadata(path: Path) -> tuple[str, str, list[str]]:
    """(name, version, Requires-Dist lines) from a wheel's METADATA."""
    with zipfile.ZipFile(path) as zf:
        (meta,) = [n for n in zf.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA")]
        msg = HeaderParser().parsestr(zf.read(meta).decode("utf-8"))
    return msg["Name"], msg["Version"], msg.get_all("Requires-Dist") or []


# ---------------------------------------------------------------------------------------------------- the walk

@dataclass
class Dist:
    """One distribution the machine would have: its version (None: unknown here) and requirements (None: unknown
    here, an image package whose own needs the image meets)."""
    version: str | None
    requires: list[str] | None
    source: str  # "image", or the wheel's path


@dataclass
class Walk:
    needed: dict[str, set[str]] = field(default_factory=dict)  # name -> extras asked for
    edges: list[tuple[str, str]] = field(default_factory=list)  # (requirement, required by)
    missing: list[tuple[str, str]] = field(default_factory=list)  # (requirement, required by): no such dist
    unmet: list[tuple[str, str, str]] = field(default_factory=list)  # (requirement, by, version found)
    unverified: list[tuple[str, str]] = field(default_factory=list)  # (requirement, by): version unknown here
    left: list[tuple[str, str]] = field(default_factory=list)  # (requirement, by): in LEAVE, not carried


def walk(roots: list[Requirement], resolve) -> Walk:
    """Follow requirements from `roots`; `resolve(name) -> Dist | None`. Records what is needed, with which extras,
    and each requirement that no dist meets (missing, or a known version outside its specifier)."""
    w = Walk()
    todo = [(req, "pyproject.toml") for req in roots]
    while todo:
        req, by = todo.pop()
        name = name_of(req.name)
        w.edges.append((str(req), by))
        if name in LEAVE:
            w.left.append((str(req), by))
            continue
        dist = resolve(name)
        if dist is None:
            w.missing.append((str(req), by))
            continue
        if dist.version is None:
            if req.specifier:
                w.unverified.append((str(req), by))
        elif not req.specifier.contains(Version(dist.version), prereleases=True):
            w.unmet.append((str(req), by, dist.version))
        new = set(req.extras) - w.needed.get(name, set())
        first = name not in w.needed
        w.needed.setdefault(name, set()).update(req.extras)
        if dist.requires is None or not (first or new):
            continue
        asked = w.needed[name]
        for text in dist.requires:
            sub = Requirement(text)
            if applies(sub, asked if first else new):
                todo.append((sub, f"{name}=={dist.version}" + (f"[{','.join(sorted(asked))}]" if asked else "")))
    return w


# ---------------------------------------------------------------------------------------------------- wheels

def pip_download(name: str, version: str, dest: Path) -> Path:
    """The cp312 manylinux x86-64 wheel of name==version into `dest` (a pure-Python one built from the sdist where
    PyPI has no wheel)."""
    dest.mkdir(parents=True, exist_ok=True)
    found = find_wheel(dest, name, version)
    if found:
        return found
    flags = ["--no-deps", "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp"]
    for platform in PLATFORMS:
        flags += ["--platform", platform]
    cmd = [sys.executable, "-m", "pip", "download", "-q", *flags, "-d", str(dest), f"{name}=={version}"]
    run = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if run.returncode != 0:  # no wheel on PyPI: build one here, acceptable only if pure Python
        build = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dest),
                                f"{name}=={version}"], check=False, capture_output=True, text=True)
        if build.returncode != 0:
            raise SystemExit(f"no wheel for {name}=={version}:\n{run.stderr[-1500:]}\n{build.stderr[-1500:]}")
    found = find_wheel(dest, name, version)
    if found is None:
        raise SystemExit(f"pip left no wheel of {name}=={version} in {dest}")
    _, _, _, tags = parse_wheel_filename(found.name)
    if not any(t.platform == "any" or "manylinux" in t.platform for t in tags):
        raise SystemExit(f"{found.name}: built here for this machine's platform, not portable to the device")
    return found


def find_wheel(folder: Path, name: str, version: str) -> Path | None:
    for path in folder.glob("*.whl"):
        wname, wversion, _, _ = parse_wheel_filename(path.name)
        if wname == name_of(name) and wversion == Version(version):
            return path
    return None


def record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def strip_wheel(src: Path, dst: Path, patterns: tuple[str, ...]) -> int:
    """Copy wheel `src` to `dst` without the entries matching `patterns` (fnmatch, `*` crosses `/`), dropping their
    RECORD lines (pip checks RECORD against the files). Entry attributes (the executable bit of Ray's binaries) are
    kept. Returns the number of entries dropped."""
    def dropped_name(path: str) -> bool:
        return any(fnmatch.fnmatchcase(path, pattern) for pattern in patterns)

    dropped = 0
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        (record,) = [n for n in zin.namelist() if n.count("/") == 1 and n.endswith(".dist-info/RECORD")]
        for info in zin.infolist():
            if dropped_name(info.filename):
                dropped += 1
                continue
            data = zin.read(info)
            if info.filename == record:  # lines are path,hash,size; a path with a comma is quoted (csv)
                rows = list(csv.reader(io.StringIO(data.decode("utf-8"))))
                out = io.StringIO()
                csv.writer(out, lineterminator="\n").writerows(r for r in rows if r and not dropped_name(r[0]))
                data = out.getvalue().encode("utf-8")
            zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED if info.compress_type else zipfile.ZIP_STORED)
    return dropped


def pack(sizes: dict[str, int], limit: int, first: tuple[str, ...] = ()) -> list[list[str]]:
    """Split files into batches of at most `limit` bytes: first-fit decreasing, with the files named in `first`
    placed in batch 1 before the rest (what the first call needs). A file larger than `limit` is an error."""
    too_big = [f"{k} ({v / MIB:.1f} MiB)" for k, v in sizes.items() if v > limit]
    if too_big:
        raise ValueError(f"larger than one batch ({limit / MIB:.0f} MiB): {', '.join(too_big)}")
    batches: list[list[str]] = []
    room: list[int] = []
    order = [k for k in first if k in sizes] + sorted((k for k in sizes if k not in first), key=lambda k: -sizes[k])
    if order and first:
        batches.append([]), room.append(limit)
    for key in order:
        size = sizes[key]
        slot = 0 if key in first else next((i for i, r in enumerate(room) if size <= r), None)
        if slot is None or room[slot] < size:
            if key in first:
                raise ValueError(f"the first batch's files ({', '.join(first)}) exceed {limit / MIB:.0f} MiB")
            batches.append([]), room.append(limit)
            slot = len(batches) - 1
        batches[slot].append(key)
        room[slot] -= size
    return batches


# ---------------------------------------------------------------------------------------------------- build

def exact_pins(roots: list[Requirement]) -> dict[str, str]:
    """{name: version} of the roots pinned with `==` in pyproject.toml itself (lmms-eval==0.7.3, ray==2.60.0)."""
    pins = {}
    for req in roots:
        specs = list(req.specifier)
        if len(specs) == 1 and specs[0].operator == "==" and "*" not in specs[0].version:
            pins[name_of(req.name)] = specs[0].version
    return pins


def plan_closure(roots, pins, image, cache: Path, carry: set[str]) -> tuple[Walk, dict[str, Path]]:
    """Download the closure's wheels into `cache`. Image packages travel only when named in `carry` or when their
    known version fails a requirement (found by walking again until nothing changes). Versions: constraints.txt,
    else an exact pin in pyproject.toml."""
    wheels: dict[str, Path] = {}
    carry = set(carry)
    pins = {**exact_pins(roots), **pins}

    def resolve(name: str) -> Dist | None:
        if name in image and name not in carry:
            return Dist(image[name], None, "image")
        if name not in pins:
            return None
        if name not in wheels:
            print(f"  {name}=={pins[name]}", flush=True)
            wheels[name] = pip_download(name, pins[name], cache)
        _, version, requires = wheel_metadata(wheels[name])
        return Dist(version, requires, str(wheels[name]))

    while True:
        w = walk(roots, resolve)
        too_old = {name_of(Requirement(r).name) for r, _, _ in w.unmet} & (set(image) - carry)
        if not too_old:
            break
        print(f"image versions too old, carrying: {', '.join(sorted(too_old))}")
        carry |= too_old
    needed = {n: wheels[n] for n in w.needed if n in wheels}
    return w, needed


def build(args) -> None:
    pins, image = read_pins(REPO / "constraints.txt"), read_image(REPO / "scripts" / "device_image.txt")
    roots = project_roots(REPO / "pyproject.toml", args.extras.split(",") if args.extras else EXTRAS)
    cache = REPO / ".whl-cache"
    print(f"closure of promprune[{args.extras or ','.join(EXTRAS)}] beyond the image, pinned by constraints.txt:")
    carry = {name_of(n) for n in [*CARRY, *args.carry]}
    for name in sorted(set(CARRY) & set(image)):
        print(f"carried although the image has it: {name}: {CARRY[name]}")
    w, wheels = plan_closure(roots, pins, image, cache / "pypi", carry)
    problems = [f"missing (no pin, not in the image): {r}  <- {by}" for r, by in w.missing]
    problems += [f"unmet: {r}  <- {by}  (found {v})" for r, by, v in w.unmet]
    if problems:
        raise SystemExit("\n".join(problems))
    files: dict[str, Path] = {}
    for name, path in sorted(wheels.items()):
        if name in STRIP:
            stripped = cache / "stripped" / path.name
            stripped.parent.mkdir(parents=True, exist_ok=True)
            if not stripped.exists() or stripped.stat().st_mtime < path.stat().st_mtime:
                n = strip_wheel(path, stripped, STRIP[name])
                print(f"{path.name}: dropped {n} entries under {', '.join(STRIP[name])} "
                      f"({path.stat().st_size / MIB:.1f} -> {stripped.stat().st_size / MIB:.1f} MiB)")
            path = stripped
        files[path.name] = path
    first = tuple(files[wheels[n].name].name for n in FIRST if n in wheels)
    batches = pack({k: p.stat().st_size for k, p in files.items()}, int(args.limit_mib * MIB), first)
    for old in REPO.glob(".whl[0-9]*"):
        shutil.rmtree(old)
    image_edges = [{"requirement": r, "by": by} for r, by in w.edges
                   if name_of(Requirement(r).name) in image and name_of(Requirement(r).name) not in wheels]
    for i, batch in enumerate(batches, 1):
        folder = REPO / f".whl{i}"
        folder.mkdir()
        for key in batch:
            os.link(files[key], folder / key) if _same_fs(files[key], folder) else shutil.copy2(files[key], folder)
        if i == 1:
            (folder / REQUIREMENTS_FILE).write_text(json.dumps(image_edges, indent=1) + "\n")
    report(w, "the closure")
    print(f"\n{len(files)} wheels in {len(batches)} batches (limit {args.limit_mib:g} MiB):")
    for i, batch in enumerate(batches, 1):
        size = sum(files[k].stat().st_size for k in batch)
        print(f"  .whl{i}: {len(batch)} wheels, {size / MIB:.1f} MiB")
    if w.unverified:
        print(f"\n{len(w.unverified)} requirements on image packages whose version is unknown here "
              "(check-installed checks them there):")
        for r, by in sorted(set(w.unverified)):
            print(f"  {r}  <- {by}")


def _same_fs(a: Path, b: Path) -> bool:
    return a.stat().st_dev == b.stat().st_dev


# ---------------------------------------------------------------------------------------------------- checks

def batch_dists(folders: list[Path]) -> dict[str, Dist]:
    """Every wheel in the batch folders; two versions of one package is an error (pip would install both)."""
    dists: dict[str, Dist] = {}
    for folder in folders:
        for path in sorted(folder.glob("*.whl")):
            name, version, requires = wheel_metadata(path)
            key = name_of(name)
            if key in dists:
                raise SystemExit(f"{key} twice: {dists[key].source} and {path}")
            dists[key] = Dist(version, requires, str(path))
    return dists


def report(w: Walk, what: str) -> int:
    """Print the walk's problems; returns how many requirements are not met."""
    for r, by in sorted(set(w.missing)):
        print(f"MISSING  {r}  <- {by}")
    for r, by, v in sorted(set(w.unmet)):
        print(f"UNMET    {r}  <- {by}  ({what} has {v})")
    for name in sorted({name_of(Requirement(r).name) for r, _ in w.left}):
        print(f"LEFT     {name}: {LEAVE[name]} (never imported by the pipeline; not carried)")
    bad = len(set(w.missing)) + len(set(w.unmet))
    print(f"{len(w.needed)} distributions needed, {len(w.edges)} requirements followed: "
          + ("all met" if not bad else f"{bad} not met"))
    return bad


def check(args) -> int:
    """Every requirement of the closure met by the batches + the image list (versions where known there)."""
    image = read_image(REPO / "scripts" / "device_image.txt")
    folders = sorted(REPO.glob(".whl[0-9]*"), key=lambda p: int(p.name[4:]))
    if not folders:
        raise SystemExit("no batches (.whl1, ...): run `python scripts/device_wheels.py build` first")
    dists = batch_dists(folders)
    w = walk(project_roots(REPO / "pyproject.toml"),
             lambda name: dists.get(name) or (Dist(image[name], None, "image") if name in image else None))
    unused = sorted(set(dists) - set(w.needed))
    if unused:
        print(f"UNUSED   wheels nobody requires: {', '.join(unused)}")
    shadowing = sorted(set(dists) & set(image))
    print(f"batches: {', '.join(f.name for f in folders)}; wheels shadowing an image package: "
          f"{', '.join(f'{n} {image[n] or chr(63)} -> {dists[n].version}' for n in shadowing) or 'none'}")
    return min(1, report(w, "the batch or image") + len(unused))


def check_installed(args) -> int:
    """On the machine: the closure's requirements against the versions importable there (importlib.metadata over
    sys.path, so PYTHONPATH's folders first, as Python imports them). Packages installed under `--site` (the
    batches) are followed into their own requirements; image packages are taken as they are (the image meets its
    own needs), except that an image package requiring a carried one at a version the batches do not have is
    reported (a carried package shadows the image's copy for everything). With --image-only, only the
    requirements on image packages that batch 1's REQUIREMENTS.json lists (before the other batches are there)."""
    from importlib import metadata

    site = Path(args.site).resolve()

    def carried(dist) -> bool:
        path = Path(str(getattr(dist, "_path", "")))
        return path.is_absolute() and site in path.resolve().parents

    def resolve(name: str) -> Dist | None:
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            return None
        return Dist(dist.version, (dist.requires or []) if carried(dist) else None, str(getattr(dist, "_path", "?")))

    if args.image_only:
        w = Walk()
        for edge in json.loads(Path(args.image_only).read_text()):
            req = Requirement(edge["requirement"])
            dist = resolve(name_of(req.name))
            if dist is None:
                w.missing.append((str(req), edge["by"]))
            elif not req.specifier.contains(Version(dist.version), prereleases=True):
                w.unmet.append((str(req), edge["by"], dist.version))
            w.edges.append((str(req), edge["by"]))
            w.needed.setdefault(name_of(req.name), set())
        return min(1, report(w, "the image"))
    w = walk(project_roots(REPO / "pyproject.toml"), resolve)
    bad = report(w, "this machine")
    for line in shadow_conflicts(list(metadata.distributions()), carried):
        print(line)
    return min(1, bad)


def shadow_conflicts(dists, carried) -> list[str]:
    """Image packages that require a carried package at a version the batches do not have (the carried copy comes
    first on sys.path, for them too). An image package that is itself carried is skipped: its copy is not imported."""
    shadowed = {name_of(d.metadata["Name"]): d.version for d in dists if carried(d)}
    lines = []
    for dist in dists:
        if carried(dist) or name_of(dist.metadata["Name"]) in shadowed:
            continue
        for text in dist.requires or []:
            req = Requirement(text)
            version = shadowed.get(name_of(req.name))
            if version and applies(req, set()) and not req.specifier.contains(Version(version), prereleases=True):
                lines.append(f"SHADOWED {dist.metadata['Name']} {dist.version} (image) requires {req}; the batches' "
                             f"{req.name} {version} comes first on sys.path")
    return lines


def write_dist_info(args) -> None:
    """This project's metadata and entry points (no code: the working tree on PYTHONPATH is the code), so
    importlib.metadata finds `promprune` and its entry points (lmms-eval's model plugin, the model factories)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    target = Path(args.target)
    info = target / f"{project['name']}-{project['version']}.dist-info"
    shutil.rmtree(target, ignore_errors=True)
    info.mkdir(parents=True)
    files = {"METADATA": f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n",
             "INSTALLER": "gpu_checklist\n",
             "entry_points.txt": "".join(f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n"
                                         for group, eps in project.get("entry-points", {}).items())}
    for fname, text in files.items():
        (info / fname).write_text(text)
    rec = [f"{info.name}/{f},{record_hash(t.encode())},{len(t.encode())}" for f, t in files.items()]
    (info / "RECORD").write_text("\n".join(rec + [f"{info.name}/RECORD,,"]) + "\n")
    print(f"wrote {info}")


def pin_image(args) -> int:
    """Fill the image list (scripts/device_image.txt) with the versions a lent machine's `pip freeze` shows (the
    file `gpu_checklist.sh --install-batch 1` writes, image-freeze.txt): known versions make the closure carry what
    the image has too old, and stop carrying what it has. Packages there but not in the list are added below a
    comment (the device notes list only some); comments and order stay."""
    freeze = {name: version for name, version in read_image(Path(args.freeze)).items() if version}  # no `@ url`
    if not freeze:
        raise SystemExit(f"{args.freeze}: no NAME==VERSION lines (is it `pip freeze --all` output?)")
    path = Path(args.image)
    out, seen, changed = [], set(), []
    for line in path.read_text().splitlines():
        entry = list_entry(line)
        if entry is None:
            out.append(line)
            continue
        name, old = entry
        key = name_of(name)
        seen.add(key)
        if key in freeze and freeze[key] != old:
            changed.append(f"{name} {old or '?'} -> {freeze[key]}")
            line = f"{name}=={freeze[key]}"
        out.append(line)
    added = sorted(set(freeze) - seen)
    if added:
        out.append("# on the lent machine (its pip freeze) but not in its device notes; added by "
                   "`device_wheels.py pin-image`")
        out += [f"{name}=={freeze[name]}" for name in added]
    path.write_text("\n".join(out) + "\n")
    print(f"{path}: {len(changed)} versions set or changed, {len(added)} packages added")
    for line in changed:
        print(f"  {line}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="download the closure, strip Ray, write the batches")
    b.add_argument("--limit-mib", type=float, default=BATCH_LIMIT / MIB, help="batch size limit")
    b.add_argument("--carry", nargs="*", default=[], help="image packages to carry anyway (another version), "
                   "besides CARRY's")
    b.add_argument("--extras", default=None, help="pyproject extras, comma-separated (default: "
                   "pipeline)")
    sub.add_parser("check", help="the batches + the image list meet every requirement of the closure")
    c = sub.add_parser("check-installed", help="on the machine: the closure against what is importable there")
    c.add_argument("--image-only", metavar="REQUIREMENTS_JSON", help="only batch 1's list of image requirements")
    c.add_argument("--site", default=str(REPO / ".site"), help="where the batches are installed")
    d = sub.add_parser("dist-info", help="write this project's metadata (entry points) into a folder")
    d.add_argument("--target", required=True)
    f = sub.add_parser("pin-image", help="set the image list's versions from a lent machine's pip freeze")
    f.add_argument("freeze", help="image-freeze.txt, as gpu_checklist.sh --install-batch 1 writes it")
    f.add_argument("--image", default=str(REPO / "scripts" / "device_image.txt"))
    args = ap.parse_args(argv)
    if args.cmd == "build":
        build(args)
        return 0
    return {"check": check, "check-installed": check_installed, "dist-info": write_dist_info,
            "pin-image": pin_image}[args.cmd](args) or 0


if __name__ == "__main__":
    sys.exit(main())
