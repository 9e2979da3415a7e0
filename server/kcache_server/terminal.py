"""Text that came from a client or the database, made safe to print on a terminal."""

from __future__ import annotations

import unicodedata

__all__ = ["printable"]


def printable(text: str) -> str:
    """``text`` with control, format and separator characters escaped (``\\x1b``, ``\\u202e``).

    Those are what a terminal interprets (colours, cursor moves, a title, bidi
    reordering); a stored kernel name, job id or token name must show as text, not act.
    """
    if text.isprintable():
        return text
    return "".join(
        ascii(ch)[1:-1] if unicodedata.category(ch)[0] == "C" or ch in "\u2028\u2029" else ch
        for ch in text
    )
