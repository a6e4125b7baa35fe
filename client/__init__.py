"""difftape.client: run difftape programs on a difftape server.

Change one line, ``ti.init(arch=ti.remote, server="http://host:8000", token=...)``, and the
same program (fields, kernels, ``ti.ad.Tape``, ``kernel.grad``, ``to_numpy``) runs on the
server: kernels are compiled there from the IR this process's frontend builds, fields live
there, and launches are batched into few requests (see :mod:`difftape.client.runtime`).
``connect(url, token)`` gives explicit sessions and jobs (:mod:`difftape.client.session`).
"""

from .errors import (
    AuthenticationError,
    QuotaExceededError,
    RemoteError,
    SessionLostError,
)
from .session import Connection, Job, Session, as_job, connect
from .transport import HttpTransport, LocalTransport

__all__ = ["AuthenticationError", "Connection", "HttpTransport", "Job", "LocalTransport",
           "QuotaExceededError", "RemoteError", "Session", "SessionLostError", "as_job",
           "connect"]
