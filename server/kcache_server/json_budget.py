"""How many JSON values a request body holds, counted as it streams in, before it is parsed.

Parsing a JSON body is one call into C (``json.loads``, pydantic's ``validate_json``)
that holds the GIL from its first byte to its last. Parsing on a worker thread keeps
the work off the event loop, but not the GIL: a 17 MiB resolve of a million
specialization keys held it for 0.2 s on a quiet machine (seconds on a loaded one),
and every request of the process waited, ``/healthz`` included. What that call costs
grows with the number of values in the text far more than with its bytes (a 30 MiB
string parses in milliseconds), so the server bounds the values before it parses
(``max_request_values``, published in ``/openapi.json``'s ``info.x-limits``):
:class:`JsonValueCounter` is fed each chunk as it arrives and says when a body holds
more, and such a body is refused (413) without being parsed at all.

The count is an upper bound on the values (every member's value, every array element
and the top-level value): each value but a container's first follows a ``,``, and a
first one follows a ``[`` or a ``{``, so it is ``1 + commas + opening brackets``
outside strings (an empty container counts one it lacks). Strings are told apart with
a few byte-string operations per chunk, all in C (no regular expression, no loop
per character): escaped backslashes are dropped, then escaped quotes, and what is
left between quotes is string content. The state kept between chunks is whether the
last one ended inside a string, and a lone backslash it ended with.
"""

from __future__ import annotations

__all__ = ["JsonValueCounter"]


class JsonValueCounter:
    """An upper bound on the values of a JSON text fed in chunks (:meth:`feed`).

    Malformed text is counted as well as it can be; the parser that runs afterwards
    says what is wrong with it.
    """

    def __init__(self) -> None:
        #: The values counted so far (the top-level value included).
        self.values = 1
        self._in_string = False
        self._carry = b""  # a lone backslash that ended the last chunk (inside a string)

    def feed(self, chunk: bytes) -> int:
        """Count ``chunk`` (the text's next bytes); the values counted so far."""
        data = self._carry + chunk if self._carry else chunk
        self._carry = b""
        if b"\\" in data:  # only strings hold backslashes in JSON
            data = data.replace(b"\\\\", b"")  # escaped backslashes: the rest escape one byte each
            if data.endswith(b"\\"):  # the byte it escapes is the next chunk's first
                data, self._carry = data[:-1], b"\\"
            data = data.replace(b'\\"', b"")  # escaped quotes: every quote left delimits a string
        parts = data.split(b'"')
        # Parts alternate outside and inside strings; an odd number of quotes flips the state.
        outside = b"".join(parts[1::2] if self._in_string else parts[0::2])
        if len(parts) % 2 == 0:
            self._in_string = not self._in_string
        self.values += outside.count(b",") + outside.count(b"[") + outside.count(b"{")
        return self.values
