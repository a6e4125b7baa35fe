"""A persistent pool of worker threads that run compiled task chunks.

Compiled tasks are ``ctypes.CFUNCTYPE`` pointers, and ctypes releases the GIL for the duration
of a foreign call, so Python threads give real parallelism here. Workers stay alive between
launches (starting threads per launch would cost far more than small kernels take). The calling
thread takes chunks too. Chunks are handed out dynamically, so uneven iterations balance.
"""

from __future__ import annotations

import itertools
import threading


class ThreadPool:
    def __init__(self, num_threads: int) -> None:
        self.num_threads = num_threads
        self._job = None
        self._lock = threading.Lock()
        self._start = [threading.Event() for _ in range(num_threads - 1)]
        self._done = threading.Event()
        self._remaining = 0
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
            self._run_chunks(tid)
            with self._lock:
                self._remaining -= 1
                if self._remaining == 0:
                    self._done.set()

    def _run_chunks(self, tid: int) -> None:
        fn, ctx, begin, end, chunk, counter = self._job
        while True:
            k = next(counter)
            b = begin + k * chunk
            if b >= end:
                return
            fn(ctx, b, min(end, b + chunk), tid)

    def run(self, fn, ctx: int, begin: int, end: int, chunks_per_thread: int = 4) -> None:
        """Run ``fn(ctx, b, e, tid)`` over [begin, end) split into chunks, on all threads."""
        n = end - begin
        nchunks = self.num_threads * chunks_per_thread
        chunk = max(1, -(-n // nchunks))
        self._job = (fn, ctx, begin, end, chunk, itertools.count())
        helpers = min(self.num_threads - 1, max(0, -(-n // chunk) - 1))
        if helpers == 0:
            fn(ctx, begin, end, 0)
            return
        self._done.clear()
        self._remaining = helpers
        for k in range(helpers):
            self._start[k].set()
        self._run_chunks(0)
        self._done.wait()

    def close(self) -> None:
        self._closed = True
        for ev in self._start:
            ev.set()
