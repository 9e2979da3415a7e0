"""Token scopes, weakest first; each includes the ones before it.

A module of its own (no imports) so ``kcache token create --scope`` can offer them
without loading the server: ``kcache --help`` stays instant.
"""

from __future__ import annotations

__all__ = ["SCOPES"]

#: read: resolve existing artifacts and fetch; report: post client audit events;
#: compile: cause compiles; admin: maintenance, pins, tokens.
SCOPES = ("read", "report", "compile", "admin")
