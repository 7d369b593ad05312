"""Reading a spec file: YAML, `include:` chains (deep merge, the including file wins) and `--set` overrides; the
relative paths of `plugins` and `include_path` resolved against the directory of the file that names them. A file
larger than `frontdoor.MAX_SPEC_BYTES` is refused unparsed (at most that much is read)."""
from __future__ import annotations

import copy
from pathlib import Path

import yaml

from pipelines.frontdoor import MAX_SPEC_BYTES, read_capped, too_large
from pipelines.plugins import resolve_paths
from pipelines.spec.errors import SpecError


class UniqueKeys(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (the safe loader kept the last and dropped the
    first without a word: two ``grid:`` blocks ran one). Keys a ``<<`` merge brings may repeat, as YAML means them."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            first: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                mark = key_node.start_mark
                try:
                    line, column = first.setdefault(key, (mark.line, mark.column))
                except TypeError:  # an unhashable key: the safe loader's own error says so
                    continue
                if (line, column) != (mark.line, mark.column):
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key!r} given twice (first on line {line + 1}): YAML would keep only the "
                                    "last; remove one or merge them", mark)
        return super().construct_mapping(node, deep=deep)


def load_raw(path: str | Path, overrides: list[str] | None = None) -> dict:
    """The spec file as a dict, `include:` chains merged (this file wins), `--set` overrides applied."""
    path = Path(path)
    if path.is_dir():
        raise SpecError([f"{path} is a directory: give a spec file in it (e.g. sweeps/quickstart.yaml)"], str(path))
    if not path.is_file():
        raise SpecError([f"spec file not found: {path}{_in_job_note(path)}"], str(path))
    raw = _load_with_includes(path, seen=())
    _refuse_overlapping_overrides(overrides or [], str(path))
    for item in overrides or []:
        _apply_override(raw, item, str(path))
    return resolve_paths(raw, Path.cwd())  # what --set gave, relative to where the command runs


def _in_job_note(path: Path) -> str:
    """For a Ray job (`pipelines.paths.in_ray_job`), what a spec path that is not found is relative to: Ray's copy
    of the job's working directory (what `--working-dir` uploaded), and the spec of that name under ``sweeps/`` if
    there is one (a spec named without its folder)."""
    from pipelines import paths

    if not paths.in_ray_job():
        return ""
    note = (f" (in a Ray job, a relative path is relative to Ray's copy of the --working-dir it uploaded, "
            f"{Path.cwd()}: name the spec as it lies in that folder")
    guess = Path("sweeps") / path.name
    if not path.is_absolute() and path != guess and guess.is_file():
        return f"{note}; did you mean {guess}?)"
    return f"{note}, e.g. sweeps/<spec>.yaml, and submit from the checkout's root)"


def _load_with_includes(path: Path, seen: tuple) -> dict:
    if path.resolve() in seen:
        raise SpecError([f"include cycle: {' -> '.join(str(p) for p in seen + (path,))}"], str(path))
    problem = too_large(path)
    if problem:
        raise SpecError([problem], str(path))
    try:
        raw = read_capped(path)
        if len(raw) > MAX_SPEC_BYTES:  # it grew since `stat`
            raise SpecError([too_large(path) or f"more than {MAX_SPEC_BYTES >> 20} MiB: not a sweep spec"], str(path))
        data = yaml.load(raw.decode("utf-8"), Loader=UniqueKeys) or {}
    except UnicodeDecodeError as exc:
        raise SpecError([f"not UTF-8 text (byte {exc.start}: {exc.reason}); save the spec as UTF-8"], str(path)) \
            from None
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        line = f"line {where.line + 1}, column {where.column + 1}: " if where is not None else ""
        problem = str(getattr(exc, "problem", None) or exc)
        fix = "; YAML indents with spaces only: replace the tab with spaces" if "'\\t'" in problem else ""
        raise SpecError([f"malformed YAML: {line}{problem}{fix}"], str(path)) from None
    except OSError as exc:
        raise SpecError([f"cannot read the spec ({exc.strerror})"], str(path)) from None
    if not isinstance(data, dict):
        raise SpecError([f"top level must be a mapping, got {type(data).__name__}"], str(path))
    data = resolve_paths(data, path.resolve().parent)  # plugins, include_path: relative to the file that names them
    include = data.pop("include", None)
    if include is None:
        return data
    if not isinstance(include, str):
        raise SpecError([f"include: must be a file path string, got {include!r}"], str(path))
    base_path = (path.parent / include)
    if base_path.is_dir():
        raise SpecError([f"include: {base_path} is a directory: name a spec file in it"], str(path))
    if not base_path.is_file():
        raise SpecError([f"include: file not found: {base_path}"], str(path))
    base = _load_with_includes(base_path, seen + (path.resolve(),))
    return deep_merge(base, data)


def deep_merge(base: dict, top: dict) -> dict:
    """Recursive merge of mappings; `top` wins; lists and scalars are replaced, not concatenated."""
    out = copy.deepcopy(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _refuse_overlapping_overrides(overrides: list[str], source: str) -> None:
    """Two `--set` for one field (or for a field and one inside it): applied in order, the later would silently undo
    the earlier (`limit=8 --set limit=80` ran 80), so both are named instead. Items without `=` are left to
    `_apply_override`'s own message."""
    seen: dict[tuple, str] = {}
    for item in overrides:
        if "=" not in item:
            continue
        keys = tuple(k.strip() for k in item.split("=", 1)[0].strip().split("."))
        for other_keys, other in seen.items():
            shorter = min(len(keys), len(other_keys))
            if keys[:shorter] == other_keys[:shorter]:
                what = ("set the same field" if keys == other_keys else
                        f"overlap ({'.'.join(keys[:shorter])} holds the other)")
                raise SpecError([f"overrides {other!r} and {item!r} {what}: the later would silently replace the "
                                 "earlier; give each field once"], source)
        seen[keys] = item


def _apply_override(raw: dict, item: str, source: str) -> None:
    """`grid.budget=[8,4]` sets raw["grid"]["budget"] = [8, 4] (value parsed as YAML)."""
    if "=" not in item:
        raise SpecError([f"override {item!r}: expected key=value, e.g. limit=8 or grid.budget=[8,4]"], source)
    key, value = item.split("=", 1)
    keys = key.strip().split(".")
    if not all(k.strip() for k in keys):  # "=5", "grid..mu=1": "- : unknown field" said nothing
        raise SpecError([f"override {item!r}: the key before '=' names no field; expected key=value with a dotted "
                         "field path, e.g. limit=8 or grid.budget=[8,4]"], source)
    if keys[0] == "include":  # includes are merged when the file is read, before any override: it would do nothing
        raise SpecError([f"override {item!r}: include is read with the spec file, before --set, so it cannot be "
                         "overridden; write the include into a spec file of your own (include: <that spec> plus the "
                         "keys that differ), or --set the fields themselves"], source)
    try:
        parsed = yaml.safe_load(value)
    except yaml.YAMLError:
        raise SpecError([f"override {item!r}: the value is not valid YAML; quote strings with special characters"],
                        source) from None
    node = raw
    for i, k in enumerate(keys[:-1]):
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise SpecError([f"override {item!r}: {not_a_mapping('.'.join(keys[:i + 1]), node)}"], source)
    node[keys[-1]] = parsed


MAX_SHOWN_VALUE = 300  # characters of a field's value shown in `not_a_mapping`'s fix; a longer one is elided


def not_a_mapping(field: str, value) -> str:
    """Why ``--set <field>.<key>=...`` cannot reach into ``field`` (its ``value`` is a list or a scalar: --set walks
    mappings only), and the fix: set the whole field, its value now shown to edit when short."""
    if isinstance(value, list):
        what = (f"a list ({len(value)} entr{'y' if len(value) == 1 else 'ies'}), and a dotted key reaches into "
                "mappings only (it cannot index a list)")
    else:
        what = f"{value!r}, not a mapping with fields to set"
    now = yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=10 ** 6).strip()
    now = now.removesuffix("...").strip()  # a plain scalar's document end marker
    shown = len(now) <= MAX_SHOWN_VALUE and "'" not in now
    example = f"--set '{field}={now}' (its value now) with your change made in it" if shown else \
        f"--set '{field}=[...]' with every entry written out" if isinstance(value, list) else f"--set '{field}=...'"
    return f"{field} is {what}; set the whole field instead, e.g. {example}"
