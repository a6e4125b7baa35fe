"""difftape.server: the compile-and-execute service.

``create_app(settings)`` (``app.py``) builds the gateway: FastAPI routers per resource
(``routers/``), bearer auth against the database (``db.py``: SQLite, or PostgreSQL shared by
several gateways, requests for sessions another gateway runs forwarded to it:
``forward.py``), sessions whose engines run in spawned worker processes (``sessions.py``,
``worker.py``, ``engine.py``), a job queue with fair share between users (``jobs.py``).
``difftape serve`` / ``python -m difftape.server`` run it under uvicorn.
The contract: ``PROTOCOL.md``.
"""
