"""Explicit sessions and jobs: ``difftape.client.connect(url, token)``.

``ti.init(arch=ti.remote, ...)`` opens a session behind the scenes and ends it on
``ti.reset()``. A :class:`Connection` is for everything around that: listing and resuming
sessions, running a program in a session that outlives it (``ti.init(arch=ti.remote,
session=s)``), and submitting long batches as jobs that survive a dropped connection and can
be watched, cancelled and collected later.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np

from difftape.graph import wire
from difftape.runtime import progress as bars

from .transport import HttpTransport, default_server, default_token

TERMINAL = ("succeeded", "failed", "cancelled")


class Connection:
    """One server and one token, over one keep-alive HTTP client."""

    def __init__(self, url: str | None = None, token: str | None = None, *,
                 timeout: float = 300.0) -> None:
        self.transport = HttpTransport(url or default_server(),
                                       token if token is not None else default_token(),
                                       timeout=timeout)

    def __repr__(self) -> str:
        return f"<difftape.client.Connection to {self.transport.url}>"

    def create_session(self) -> Session:
        """A new session (a worker process with its own fields and kernels)."""
        return Session(self, self.transport.create_session())

    def session(self, session_id: str) -> Session:
        """An existing session of this user."""
        return Session(self, session_id)

    def sessions(self) -> list[dict]:
        """This user's sessions (id, state, field bytes, activity times)."""
        return self.transport.json("GET", "/v1/sessions")["sessions"]

    def job(self, job_id: str) -> Job:
        return Job(self, job_id)

    def close(self) -> None:
        self.transport.close()

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect(url: str | None = None, token: str | None = None, *,
            timeout: float = 300.0) -> Connection:
    """``difftape.client.connect("http://host:8000", token)``; ``DIFFTAPE_SERVER`` and
    ``DIFFTAPE_TOKEN`` are the defaults."""
    return Connection(url, token, timeout=timeout)


class Session:
    """A server session. Run a program in it with ``ti.init(arch=ti.remote, session=s)``
    (it stays alive after ``ti.reset()``), or drive engine ops directly."""

    def __init__(self, connection: Connection, session_id: str) -> None:
        self.connection = connection
        self.transport = connection.transport
        self.session_id = session_id

    def __repr__(self) -> str:
        return f"<difftape.client.Session {self.session_id} on {self.transport.url}>"

    def info(self) -> dict:
        return self.transport.json("GET", f"/v1/sessions/{self.session_id}")

    def resume(self) -> dict:
        """Bring a culled session back (its fields were saved on the server)."""
        return self.transport.json("POST", f"/v1/sessions/{self.session_id}/resume",
                                   idempotent=True)

    def delete(self) -> None:
        self.transport.delete_session(self.session_id)

    def batch(self, ops: list[dict]) -> list[dict]:
        """Engine ops (see server/PROTOCOL.md) in one request; their results."""
        return self.transport.batch(self.session_id, ops)

    def write(self, field_id: int, role: str, arr: np.ndarray) -> None:
        self.transport.write(self.session_id, field_id, role, arr)

    def read(self, field_id: int, role: str, dtype, shape: tuple[int, ...]) -> np.ndarray:
        return self.transport.read(self.session_id, field_id, role, np.dtype(dtype), shape)

    def submit(self, ops: list[dict], job_id: str | None = None) -> Job:
        """Queue ``ops`` as a job (202). With a ``job_id`` the submission is idempotent, so it
        is retried after a dropped connection; the job still runs once."""
        body: dict[str, Any] = {"ops": ops}
        if job_id is not None:
            body["job_id"] = job_id
        info = self.transport.json("POST", f"/v1/sessions/{self.session_id}/jobs", body,
                                   idempotent=job_id is not None)
        return Job(self.connection, info["job_id"], info)


class Job:
    """A submitted batch: status, progress events, cancellation and its result."""

    def __init__(self, connection: Connection, job_id: str, info: dict | None = None) -> None:
        self.connection = connection
        self.transport = connection.transport
        self.job_id = job_id
        self.last = info or {}

    def __repr__(self) -> str:
        """The job as last seen (``status()`` asks the server again): state and progress."""
        state = self.last.get("state", "submitted")
        done, total = self.last.get("done"), self.last.get("total")
        seen = f", {done} of {total} ops done" if total else ""
        return f"<difftape.client.Job {self.job_id}: {state}{seen}>"

    def status(self) -> dict:
        self.last = self.transport.json("GET", f"/v1/jobs/{self.job_id}")
        return self.last

    def cancel(self) -> dict:
        self.last = self.transport.json("POST", f"/v1/jobs/{self.job_id}/cancel",
                                        idempotent=True)
        return self.last

    def events(self) -> Iterator[dict]:
        """Progress as the server sends it (server-sent events) until the job ends."""
        with self.transport.client.stream("GET", f"/v1/jobs/{self.job_id}/events",
                                          headers={"Accept": "text/event-stream"}) as resp:
            if resp.status_code >= 400:
                resp.read()
                raise self.transport._error(resp)
            event, data = None, []
            for line in resp.iter_lines():
                if line.startswith("event:"):
                    event = line[6:].strip()
                elif line.startswith("data:"):
                    data.append(line[5:].strip())
                elif not line and data:
                    info = json.loads("\n".join(data))
                    self.last = info
                    yield info
                    if event == "end":
                        return
                    event, data = None, []

    def wait(self, timeout: float | None = None, progress: bool | None = None) -> dict:
        """Block until the job ends, with a progress bar of its ops (tqdm's: a widget in
        Jupyter, a text bar in a terminal). ``progress``: None shows one when tqdm is
        installed and ``DIFFTAPE_PROGRESS`` is not 0 (once the job has run a second); True
        insists (an error without tqdm); False shows none. Returns the final status."""
        deadline = None if timeout is None else time.monotonic() + timeout
        total = self.last.get("total")
        with bars.bar(total, f"job {self.job_id}", show=progress, unit="op",
                      leave=True) as pb:
            for info in self.events():
                pb.total = info.get("total", pb.total)
                pb.update(int(info.get("done", 0)) - pb.n)
                pb.set_postfix_str(str(info.get("state", "")))
                if deadline is not None and time.monotonic() > deadline:
                    break
        return self.status()

    def result(self) -> list[dict]:
        """The results of a succeeded job; a failed one raises its error (same classes as
        a synchronous batch). What the job's kernels printed goes to ``sys.stdout`` (for a
        failed job, before its error is raised)."""
        body = self.transport.json("GET", f"/v1/jobs/{self.job_id}/result")
        wire.show_output(body.get(wire.OUTPUT))
        return body["results"]


@contextlib.contextmanager
def as_job(job_id: str | None = None, progress: bool | None = None) -> Iterator[dict]:
    """Run the launches made inside the block as one server job instead of a synchronous
    batch: ``with difftape.client.as_job("train-42"): ...``. The job id makes a re-run of
    the same script after a dropped connection attach to the job instead of running it
    twice. The yielded dict gets the job's final status."""
    from difftape.runtime import program

    rt = program.get().remote
    if rt is None:
        raise RuntimeError("difftape.client.as_job needs ti.init(arch=ti.remote, ...)")
    if not hasattr(rt.transport, "json"):
        raise RuntimeError("jobs need an HTTP session")
    rt.flush()
    out: dict = {}
    rt.in_job = True
    try:
        yield out
    finally:
        rt.in_job = False
    ops, rt._queue = rt._queue, []
    if not ops:
        return
    conn = Connection.__new__(Connection)
    conn.transport = rt.transport
    job = Session(conn, rt.session_id).submit(ops, job_id or f"job-{uuid.uuid4().hex}")
    out.update(job.wait(progress=progress))
    if out.get("state") == "succeeded":
        if any(op.get("kernel_id") in rt.printing for op in ops):
            job.result()  # what the job's kernels printed, written to sys.stdout
    elif out.get("state") == "failed":
        from difftape.errors import DifftapeError

        try:
            job.result()  # raises the job's error
        except DifftapeError as e:
            index = getattr(e, "op_index", None)
            if isinstance(index, int) and 0 <= index < len(ops):
                rt._after_error(ops, index)
            raise
    else:
        from .errors import RemoteError

        raise RemoteError(f"job {job.job_id} ended {out.get('state')}")
