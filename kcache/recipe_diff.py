"""Why a recipe missed: what differs between it and the nearest recipe of the same kernel.

A miss is rarely a new kernel: it is usually a kernel the cache holds, asked for with
one header edited, a flag added, another target or toolchain. :func:`fingerprint`
keeps what tells recipes of one kernel apart (small: headers by their sha256, the
name expressions by one hash), :func:`differences` names what differs between two
fingerprints, one line each, in words a person acts on::

    header add.cuh changed (3f2a1b2c.. -> 9c01d4e5..)
    flag -lineinfo added
    flags reordered: -DA -DB -> -DB -DA
    target sm_80 -> sm_90

:func:`explain` picks the nearest of a few candidates (fewest differences, the most
recent on a tie) and bounds what it says (:class:`Explanation`). Pure: no database,
no NVRTC; the server stores fingerprints and feeds candidates in
(``kcache_server.recipe_records``).

Values of macros (``-DNAME=VALUE``) and of specializations are another team's data as
much as its source is, so what a caller may see is decided here, once: with ``values``
false (a caller below the ``compile`` scope, which the recorded recipe itself needs,
and every explanation stored with an audit row, which ``/v1/stats`` shows to any
``read`` token) a line names the macro or the specialization key and what happened to
it, never a value: ``flag -DTILE=… added``, ``specialization dtype changed``. The
nearest recipe is chosen on the real values either way.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kcache.keys import sha256_hex
from kcache.recipe import Recipe

__all__ = [
    "HIDDEN",
    "MAX_LINES",
    "MAX_LINE_CHARS",
    "NEVER_SEEN",
    "Explanation",
    "bounded",
    "differences",
    "explain",
    "fingerprint",
    "hide_value",
]

#: Differences an explanation names; the rest are counted in one last line.
MAX_LINES = 12
#: Characters of one line (longer ones end in "..").
MAX_LINE_CHARS = 200
#: What an explanation says when no recipe of the kernel is known.
NEVER_SEEN = "never seen"
#: Hex digits of a hash shown in a line.
_HASH_CHARS = 8
#: Hex digits of the nearest recipe's key in :attr:`Explanation.text`.
_KEY_CHARS = 16
#: What stands for a value a caller may not see.
HIDDEN = "…"
_MACRO_PREFIXES = ("--define-macro=", "-D")


def fingerprint(recipe: Recipe) -> dict[str, Any]:
    """What tells ``recipe`` apart from other recipes of its kernel, as a JSON object.

    Headers by name -> sha256, flags in order, target, toolchain, specialization,
    include set names, output, lto, link inputs (recipe keys or digests), and the
    sha256 of the source and of the name expressions (which are compared, never shown).
    """
    return {
        "name": recipe.name,
        "source_sha256": sha256_hex(recipe.source.encode()),
        "headers": recipe.header_hashes(),
        "flags": list(recipe.flags),
        "target": recipe.target,
        "toolchain": recipe.toolchain,
        "specialization": {
            k: list(v) if isinstance(v, tuple) else v for k, v in recipe.specialization.items()
        },
        "include_sets": list(recipe.include_sets),
        "name_expressions": sha256_hex(json.dumps(list(recipe.name_expressions)).encode()),
        "output": recipe.output,
        "lto": recipe.lto,
        "link": [
            item.recipe._identity() if item.recipe is not None else f"digest:{item.digest}"
            for item in recipe.link
        ],
    }


def _line(text: str) -> str:
    return text if len(text) <= MAX_LINE_CHARS else text[: MAX_LINE_CHARS - 2] + ".."


def _short(digest: object) -> str:
    return f"{str(digest)[:_HASH_CHARS]}.."


def _value(value: object) -> str:
    """A specialization value as a person reads it: strings bare, the rest as JSON."""
    if isinstance(value, str):
        return value
    return json.dumps(value, separators=(", ", ": "))


def _mapping(data: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    value = data.get(name)
    return value if isinstance(value, Mapping) else {}


def _sequence(data: Mapping[str, Any], name: str) -> list[Any]:
    value = data.get(name)
    return list(value) if isinstance(value, list | tuple) else []


def _include_set_lines(old: list[Any], new: list[Any]) -> Iterable[str]:
    """Sets added, removed or reordered by name; then a set whose pinned contents changed."""
    names = [[str(entry).partition("@")[0] for entry in side] for side in (old, new)]
    yield from _list_lines(names[0], names[1], "include set", "include sets")
    pins = [
        {n: str(e).partition("@")[2] for n, e in zip(ns, side, strict=True)}
        for ns, side in zip(names, (old, new), strict=True)
    ]
    for name in names[1]:
        was, now = pins[0].get(name), pins[1][name]
        if was is not None and was != now:
            shown = [_short(pin) if pin else "by name" for pin in (was, now)]
            yield f"include set {name} changed ({shown[0]} -> {shown[1]})"


def _header_lines(old: Mapping[str, Any], new: Mapping[str, Any]) -> Iterable[str]:
    for name in sorted(set(old) | set(new)):
        if name not in old:
            yield f"header {name} added"
        elif name not in new:
            yield f"header {name} removed"
        elif old[name] != new[name]:
            yield f"header {name} changed ({_short(old[name])} -> {_short(new[name])})"


def hide_value(flag: str) -> str:
    """``flag`` as a caller without the ``compile`` scope sees it: a macro's value hidden.

    ``-DTILE=64`` -> ``-DTILE=…``, ``--define-macro=TILE=64`` -> ``--define-macro=TILE=…``;
    a macro without a value and every other flag as it is.
    """
    for prefix in _MACRO_PREFIXES:
        if flag.startswith(prefix):
            name, equals, _ = flag[len(prefix) :].partition("=")
            return f"{prefix}{name}={HIDDEN}" if equals else flag
    return flag


def _list_lines(
    old: list[Any],
    new: list[Any],
    singular: str,
    plural: str,
    show: Callable[[str], str] = str,
) -> Iterable[str]:
    """Items added, removed (counted, so a repeated flag counts), then a reorder of the rest.

    Compared as they are; each shown as ``show`` gives it.
    """
    before, after = Counter(map(str, old)), Counter(map(str, new))
    added, removed = after - before, before - after
    for item in map(str, new):
        if added[item] > 0:
            added[item] -= 1
            yield f"{singular} {show(item)} added"
    for item in map(str, old):
        if removed[item] > 0:
            removed[item] -= 1
            yield f"{singular} {show(item)} removed"
    # The items both have, each in its own order: the key hashes them in order
    # (two macros defined in another order are another recipe).
    common = before & after
    kept_old, kept_new = _kept(old, common), _kept(new, common)
    if kept_old != kept_new:
        shown_old, shown_new = (" ".join(map(show, kept)) for kept in (kept_old, kept_new))
        yield f"{plural} reordered: {shown_old} -> {shown_new}"


def _kept(items: list[Any], common: Counter[str]) -> list[str]:
    left = Counter(common)
    kept = []
    for item in map(str, items):
        if left[item] > 0:
            left[item] -= 1
            kept.append(item)
    return kept


def _spec_lines(
    old: Mapping[str, Any], new: Mapping[str, Any], values: bool = True
) -> Iterable[str]:
    for key in sorted(set(old) | set(new)):
        if key not in old:
            yield f"specialization {key} added" + (f" ({_value(new[key])})" if values else "")
        elif key not in new:
            yield f"specialization {key} removed" + (f" ({_value(old[key])})" if values else "")
        elif old[key] != new[key]:
            yield (
                f"specialization {key} {_value(old[key])} -> {_value(new[key])}"
                if values
                else f"specialization {key} changed"
            )


def _scalar(name: str, old: Mapping[str, Any], new: Mapping[str, Any], label: str) -> Iterable[str]:
    a, b = old.get(name), new.get(name)
    if a != b:
        yield f"{label} {'none' if a is None else a} -> {'none' if b is None else b}"


def differences(
    old: Mapping[str, Any], new: Mapping[str, Any], *, values: bool = True
) -> list[str]:
    """What changed from fingerprint ``old`` to fingerprint ``new``, one line each (empty: alike).

    Lines are at most :data:`MAX_LINE_CHARS` long; every difference is listed
    (:func:`bounded` cuts the list for display). ``values`` false: no macro or
    specialization value is shown (see the module docstring).
    """
    show: Callable[[str], str] = str if values else hide_value
    lines: list[str] = []
    if old.get("source_sha256") != new.get("source_sha256"):
        lines.append(
            f"source changed ({_short(old.get('source_sha256'))} -> "
            f"{_short(new.get('source_sha256'))})"
        )
    lines += _scalar("name", old, new, "name")
    lines += _header_lines(_mapping(old, "headers"), _mapping(new, "headers"))
    lines += _list_lines(_sequence(old, "flags"), _sequence(new, "flags"), "flag", "flags", show)
    lines += _scalar("target", old, new, "target")
    lines += _scalar("toolchain", old, new, "toolchain")
    lines += _spec_lines(_mapping(old, "specialization"), _mapping(new, "specialization"), values)
    lines += _include_set_lines(_sequence(old, "include_sets"), _sequence(new, "include_sets"))
    if old.get("name_expressions") != new.get("name_expressions"):
        lines.append("name expressions changed")
    lines += _scalar("output", old, new, "output")
    if bool(old.get("lto")) != bool(new.get("lto")):
        lines.append(
            f"lto {'on' if old.get('lto') else 'off'} -> {'on' if new.get('lto') else 'off'}"
        )
    if _sequence(old, "link") != _sequence(new, "link"):
        lines.append("link inputs changed")
    return [_line(line) for line in lines]


def bounded(lines: Sequence[str]) -> list[str]:
    """At most :data:`MAX_LINES` of ``lines``, then ``... and N more`` for the rest."""
    if len(lines) <= MAX_LINES:
        return [_line(line) for line in lines]
    return [_line(line) for line in lines[:MAX_LINES]] + [f"... and {len(lines) - MAX_LINES} more"]


@dataclass(frozen=True)
class Explanation:
    """The nearest known recipe of a kernel and what differs from it (bounded)."""

    nearest_key: str | None = None
    differences: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        """One line: ``never seen``, or ``nearest <key[:16]>: <difference>; <difference>``."""
        if self.nearest_key is None:
            return NEVER_SEEN
        said = "; ".join(self.differences) or "no difference in what was recorded"
        return f"nearest {self.nearest_key[:_KEY_CHARS]}: {said}"


def explain(
    new: Mapping[str, Any],
    candidates: Iterable[tuple[str, Mapping[str, Any]]],
    *,
    values: bool = True,
) -> Explanation:
    """The nearest of ``candidates`` (recipe key, fingerprint), most recent first, to ``new``.

    Fewest differences wins; on a tie the earlier candidate (the more recent one).
    No candidate: :data:`NEVER_SEEN`. ``values`` false: its lines show no macro or
    specialization value (the same nearest recipe is chosen).
    """
    best: tuple[str, Mapping[str, Any], list[str]] | None = None
    for key, old in candidates:
        lines = differences(old, new)
        if best is None or len(lines) < len(best[2]):
            best = (key, old, lines)
    if best is None:
        return Explanation()
    key, old, lines = best
    return Explanation(key, bounded(lines if values else differences(old, new, values=False)))
