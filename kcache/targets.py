"""Compile targets: ``sm_XX`` / ``sm_XXa`` / ``sm_XXf`` (cubin) and ``compute_XX`` (PTX)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kcache.errors import RecipeError

__all__ = ["TARGET_FAMILIES", "Target", "parse_target", "target_regex"]

#: The families a target names: ``sm`` (a cubin for that SM) and ``compute`` (PTX).
TARGET_FAMILIES = ("sm", "compute")
# The SM number: two or three ASCII digits, no leading zero ("sm_٩٠" or "sm_090" must
# not name sm_90 under another key). Then "a" or "f" or nothing.
_SM_NUMBER = "[1-9][0-9]{1,2}"
_SUFFIX = "[af]?"
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
    ``^(?:...)$`` (ECMA's ``$`` ends the input). Three groups: family, number, suffix.

    ``sms`` narrows the number to these SMs (the ones a toolchain compiles for;
    numbers the grammar refuses are left out), ``families`` the families.
    """
    if sms is None:
        number = _SM_NUMBER
    else:
        allowed = re.compile(_SM_NUMBER)
        listed = sorted({str(int(sm)) for sm in sms if allowed.fullmatch(str(int(sm)))}, key=int)
        number = "|".join(listed) or _NOTHING
    if not families or any(family not in TARGET_FAMILIES for family in families):
        raise ValueError(f"families must be some of {TARGET_FAMILIES}, got {families!r}")
    return f"({'|'.join(families)})_({number})({_SUFFIX})"


_TARGET_RE = re.compile(target_regex())


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
        raise RecipeError(
            field,
            f"{text!r} is not a target; use sm_XX, sm_XXa, sm_XXf or compute_XX "
            '(or "auto" on a client with a GPU)',
        )
    family, number, suffix = match.groups()
    return Target(text=text, family=family, sm=int(number), suffix=suffix)
