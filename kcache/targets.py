"""Compile targets: ``sm_XX`` / ``sm_XXa`` / ``sm_XXf`` (cubin) and ``compute_XX`` (PTX)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kcache.errors import RecipeError

__all__ = ["TARGET_FAMILIES", "Target", "parse_target", "target_regex"]

#: The families a target names: ``sm`` (a cubin for that SM) and ``compute`` (PTX).
TARGET_FAMILIES = ("sm", "compute")
#: The first SM with an architecture-specific target (``sm_90a``), and with a
#: family-specific one (``sm_100f``): NVRTC has no ``sm_75a`` or ``sm_90f``.
ARCH_SPECIFIC_FROM = 90
FAMILY_SPECIFIC_FROM = 100
# The SM number: two or three ASCII digits, no leading zero ("sm_٩٠" or "sm_090" must
# not name sm_90 under another key).
_SM_NUMBER = "[1-9][0-9]{1,2}"
_SM_FROM_90 = "9[0-9]|[1-9][0-9]{2}"
_SM_FROM_100 = "[1-9][0-9]{2}"
# Matches no string, in both dialects: an SM list none of whose numbers is one.
_NOTHING = "[^\\s\\S]"


def target_regex(
    sms: Iterable[int] | None = None, *, families: Sequence[str] = TARGET_FAMILIES
) -> str:
    """The one grammar of a target, as regex text that Python's ``re`` and ECMA-262 read alike.

    Unanchored, and written so that both engines accept exactly the same strings:
    only explicit ASCII classes (no ``\\d``, ``\\w``, ``.``), no flags, no
    lookaround. :func:`parse_target` matches it with ``fullmatch`` (``$`` would
    also take a trailing newline); a JSON Schema ``pattern`` anchors it as
    ``^(?:...)$`` (ECMA's ``$`` ends the input). The suffix is part of the grammar:
    ``a`` from :data:`ARCH_SPECIFIC_FROM`, ``f`` from :data:`FAMILY_SPECIFIC_FROM`.
    Groups: the family, then the number of one of three alternatives (no suffix;
    ``a``; ``f``) and its suffix.

    ``sms`` narrows the number to these SMs (the ones a toolchain compiles for;
    numbers the grammar refuses are left out), ``families`` the families.
    """
    if sms is None:
        plain, arch, family = _SM_NUMBER, _SM_FROM_90, _SM_FROM_100
    else:
        allowed = re.compile(_SM_NUMBER)
        listed = sorted({int(sm) for sm in sms if allowed.fullmatch(str(int(sm)))})

        def numbers(least: int) -> str:
            return "|".join(str(sm) for sm in listed if sm >= least) or _NOTHING

        plain, arch, family = (
            numbers(0),
            numbers(ARCH_SPECIFIC_FROM),
            numbers(FAMILY_SPECIFIC_FROM),
        )
    if not families or any(name not in TARGET_FAMILIES for name in families):
        raise ValueError(f"families must be some of {TARGET_FAMILIES}, got {families!r}")
    return f"({'|'.join(families)})_(?:({plain})|({arch})(a)|({family})(f))"


_TARGET_RE = re.compile(target_regex())
# The grammar without the suffix rule: tells "sm_75a" (a suffix its SM lacks) from noise.
_LOOSE_RE = re.compile(f"(?:{'|'.join(TARGET_FAMILIES)})_({_SM_NUMBER})([af])")


@dataclass(frozen=True)
class Target:
    """A parsed target string."""

    text: str
    family: str  # "sm" or "compute"
    sm: int  # for example 90 for sm_90a
    suffix: str  # "", "a" or "f"

    @property
    def is_virtual(self) -> bool:
        """``compute_XX`` targets produce PTX (or LTO-IR), never a cubin."""
        return self.family == "compute"


def parse_target(text: str, field: str = "target") -> Target:
    """Parse ``text`` or raise a :class:`RecipeError` naming ``field``."""
    match = _TARGET_RE.fullmatch(text) if isinstance(text, str) else None
    if match is None:
        loose = _LOOSE_RE.fullmatch(text) if isinstance(text, str) else None
        if loose is not None:
            kind, least = (
                ("architecture-specific", ARCH_SPECIFIC_FROM)
                if loose.group(2) == "a"
                else ("family-specific", FAMILY_SPECIFIC_FROM)
            )
            raise RecipeError(
                field,
                f"{text!r} is not a target: {kind} targets ({loose.group(2)} suffix) begin "
                f"at sm_{least}{loose.group(2)}; use {text[:-1]} for SM {loose.group(1)}",
            )
        raise RecipeError(
            field,
            f"{text!r} is not a target; use sm_XX, sm_XXa (from sm_90a), sm_XXf (from "
            'sm_100f) or compute_XX (or "auto" on a client with a GPU)',
        )
    family, plain, arch, a, numbered, f = match.groups()
    return Target(text=text, family=family, sm=int(plain or arch or numbered), suffix=a or f or "")
