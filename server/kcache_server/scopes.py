"""Token scopes, weakest first; each includes the ones before it.

A module of its own (no imports) so ``kcache token create --scope`` can offer them
without loading the server: ``kcache --help`` stays instant.
"""

from __future__ import annotations

__all__ = ["ALL_SCOPES", "PUBLISH", "SCOPES"]

#: read: resolve existing artifacts and fetch; report: post client audit events;
#: compile: cause compiles; admin: maintenance, pins, tokens.
SCOPES = ("read", "report", "compile", "admin")
#: Outside the chain: publish foreign artifacts (a library cache hook's bytes under the
#: library's key, docs/design.md section 10). A ``publish`` token also reads and reports,
#: but does not compile; ``compile`` does not include it; ``admin`` does.
PUBLISH = "publish"
#: Every scope a token may be given.
ALL_SCOPES = (*SCOPES, PUBLISH)
