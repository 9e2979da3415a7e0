"""Compile targets: ``sm_XX`` / ``sm_XXa`` / ``sm_XXf`` (cubin) and ``compute_XX`` (PTX)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from kcache.errors import RecipeError

__all__ = ["Target", "parse_target"]

# fullmatch, ASCII digits, no leading zero: "sm_90\n", "sm_٩٠" or "sm_090" must not name
# sm_90 under another key.
_TARGET_RE = re.compile(r"(sm|compute)_([1-9][0-9]{1,2})([af]?)")


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
