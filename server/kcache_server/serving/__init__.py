"""The serving wing: what puts the server on the wire.

The FastAPI app and its exception handlers (:mod:`.app`), ``kcache serve`` and the other
server commands (:mod:`.cli`), the answers given below the framework for the two hot
requests (:mod:`.artifact_fastpath`, :mod:`.resolve_fastpath`: pure ASGI, in front of the
app under stock uvicorn) and the published contract (:mod:`.openapi`). It stands above the routes and everything else of the server: nothing outside it imports it.
"""
