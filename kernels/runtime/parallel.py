"""A persistent pool of worker threads that run compiled task chunks.

Compiled tasks are ``ctypes.CFUNCTYPE`` pointers, and ctypes releases the GIL for the duration
of a foreign call, so Python threads give real parallelism here. Workers stay alive between
launches (starting threads per launch would cost far more than small kernels take). The calling
thread takes chunks too. Chunks are handed out dynamically, so uneven iterations balance.

A launch finishes when its last chunk has run, not when every worker has checked in: a worker
that wakes late (another process had its core) finds the chunks taken and goes back to sleep,
so a busy machine slows a launch by the work lost, not by a scheduler time slice.
"""

from __future__ import annotations

import itertools
import threading


class _Job:
    __slots__ = ("fn", "ctx", "begin", "end", "chunk", "counter", "total", "finished", "lock",
                 "done")

    def __init__(self, fn, ctx: int, begin: int, end: int, chunk: int) -> None:
        self.fn, self.ctx, self.begin, self.end, self.chunk = fn, ctx, begin, end, chunk
        self.counter = itertools.count()
        self.total = -(-(end - begin) // chunk)
        self.finished = 0
        self.lock = threading.Lock()
        self.done = threading.Event()


class ThreadPool:
    def __init__(self, num_threads: int) -> None:
        self.num_threads = num_threads
        self._job: _Job | None = None
        self._start = [threading.Event() for _ in range(num_threads - 1)]
        self._closed = False
        self._workers = [threading.Thread(target=self._worker, args=(k + 1,), daemon=True,
                                          name=f"difftape-worker-{k + 1}")
                         for k in range(num_threads - 1)]
        for w in self._workers:
            w.start()

    def _worker(self, tid: int) -> None:
        ev = self._start[tid - 1]
        while True:
            ev.wait()
            ev.clear()
            if self._closed:
                return
            job = self._job
            if job is not None:
                self._run_chunks(job, tid)

    @staticmethod
    def _run_chunks(job: _Job, tid: int) -> None:
        fn, ctx, begin, end, chunk = job.fn, job.ctx, job.begin, job.end, job.chunk
        while True:
            b = begin + next(job.counter) * chunk
            if b >= end:
                return
            fn(ctx, b, min(end, b + chunk), tid)
            with job.lock:
                job.finished += 1
                if job.finished == job.total:
                    job.done.set()

    def run(self, fn, ctx: int, begin: int, end: int, chunks_per_thread: int = 4) -> None:
        """Run ``fn(ctx, b, e, tid)`` over [begin, end) split into chunks, on all threads."""
        n = end - begin
        nchunks = self.num_threads * chunks_per_thread
        chunk = max(1, -(-n // nchunks))
        helpers = min(self.num_threads - 1, max(0, -(-n // chunk) - 1))
        if helpers == 0:
            fn(ctx, begin, end, 0)
            return
        job = self._job = _Job(fn, ctx, begin, end, chunk)
        for k in range(helpers):
            self._start[k].set()
        self._run_chunks(job, 0)
        job.done.wait()

    def close(self) -> None:
        self._closed = True
        for ev in self._start:
            ev.set()
