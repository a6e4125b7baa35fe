"""Session engines as Ray actors: the second implementation of the worker interface.

``difftape serve --cluster ray://HOST:PORT`` (or ``auto``, or a GCS address ``HOST:PORT``; also
``DIFFTAPE_CLUSTER``) runs each session's engine as a named Ray actor instead of a local
worker process. The actor runs the same ``Engine`` the local worker runs; ``RayWorker`` gives
the gateway the same handle ``Worker`` gives (``call``, ``kill``, ``stop``, ``alive``,
``lock``, ``gone``, ``stats``, ``address``), and ``RayWorkerPool`` the same pool (``get``,
``fill``, ``close``). Nothing else in the gateway knows which kind runs a session.

* Field data moves as NumPy byte arrays: Ray keeps them out of band, in its object store,
  never as JSON lists or pickled copies.
* A session's actor goes to the gateway's own node when that node could hold it and has room
  now (the gateway is a driver there, ``--cluster auto`` or ``HOST:PORT``): both then map one
  object store, and field data moves through shared memory, as with a local worker. Across
  raylets every payload is copied into the sender's store, pulled by the receiver's object
  manager and copied again (measured on loopback: 4 MiB up + down 37-47 ms between nodes
  against 13 ms on one node). A node too small for the session (a head with ``--num-cpus=0``),
  or a gateway on Ray Client (``ray://``, no node of its own), spreads sessions over the
  nodes; a full one spills them to where Ray's default policy puts them. Whether the gateway's
  node takes sessions is what it declares to Ray (``ray start --num-cpus``/``--num-gpus``).
* Compiled code stays cached on each node's disk (``cluster_cache_dir``, a shared directory
  when one is configured), as the local workers cache it under the data dir.
* The gateway imports ``ray`` (a client of the cluster) but never the compiler: the engine is
  imported inside the actor, on its node.
* An actor that dies (its process killed, its node lost) makes ``call`` raise ``WorkerGone``
  for that session only; the session manager turns it into a 410 and resumes the session from
  its last save on the next request (``Settings.checkpoint_s``), as for a local worker.
* Actors are *detached* and named (``ray:difftape/<name>`` in the session's row): they outlive
  the gateway that started them, and any gateway of the database reaches one by its name
  (``RayWorkerPool.attach``), so requests for such sessions are never forwarded between
  gateways. A gateway that gets a request for a session another holds takes it over in the
  database (its ``epoch`` goes up) and calls the actor with that epoch; the actor refuses calls
  with an older epoch than it has seen (``WorkerMoved``: the call did not run), so the gateway
  that lost the session never runs an op unknown to the one that holds it.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import math
import os
import queue
import secrets
import threading
from typing import Any

from .problems import ProblemError
from .worker import (
    SHM_MIN,
    EnginePool,
    EngineWorker,
    StartLost,
    WorkerGone,
    WorkerMoved,
    _error_dict,
    _executor,
)

log = logging.getLogger("difftape.server")

#: Ray namespace of the engine actors (their names are ``difftape-<token>``).
NAMESPACE = "difftape"


def _ray():
    """``ray``, imported on first use: a gateway without a cluster never loads it."""
    try:
        import ray
    except ImportError as e:  # pragma: no cover - depends on the installation
        raise RuntimeError("--cluster needs Ray: pip install 'difftape[server,ray]'") from e
    return ray


def connect(address: str, namespace: str = NAMESPACE) -> dict:
    """Join the cluster at ``address`` as a driver (``auto``, ``HOST:PORT``) or a Ray client
    (``ray://HOST:PORT``); the cluster's resources. Idempotent within a process."""
    ray = _ray()
    if not ray.is_initialized():
        ray.init(address=address, namespace=namespace, log_to_driver=False,
                 logging_level=logging.WARNING)
    return ray.cluster_resources()


def own_node() -> str | None:
    """The id of the node this process is a driver on; None for a Ray client (``ray://``),
    whose objects live on the cluster's client server, not on a node of its own."""
    ray = _ray()
    if ray.util.client.ray.is_connected():
        return None
    return ray.get_runtime_context().get_node_id()


class EngineActor:
    """One session's engine on a cluster node (wrapped by ``ray.remote`` when used). Ray runs
    one method at a time per actor, so ops stay in order as in a worker process."""

    def __init__(self, engine_spec: str, engine_kwargs: dict) -> None:
        cache_dir = engine_kwargs.get("cache_dir")
        if cache_dir:
            os.makedirs(cache_dir, exist_ok=True)
            os.environ["DIFFTAPE_CACHE_DIR"] = cache_dir
        module, _, cls = engine_spec.partition(":")
        self.engine = getattr(importlib.import_module(module), cls)(**engine_kwargs)
        self.epoch = 0  # the highest epoch a call came with (see the module's docstring)
        self._thread: threading.Thread | None = None  # runs the ops (see ``execute``)
        self._ops: queue.SimpleQueue = queue.SimpleQueue()
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._answers: queue.SimpleQueue = queue.SimpleQueue()
        self._asking = False  # the running op waits for the gateway's answer

    def ready(self) -> dict:
        ray = _ray()
        return {"pid": os.getpid(), "node": ray.get_runtime_context().get_node_id()}

    def execute(self, op: dict, payload: Any = None, epoch: int = 0) -> tuple[dict, Any]:
        """``(reply, payload)`` as the worker process answers: ``{"ok": result}`` or
        ``{"error": ...}``; a payload is a uint8 NumPy array (out of band in the object
        store, one copy out of the field). ``{"moved": epoch}`` (nothing ran) for a call from
        a gateway that has not taken the session since another did. ``{"ask": ...}`` when
        the op, still running, needs more of the user's memory quota: the gateway's
        :meth:`answer` goes on with it (as a worker process asks through its pipe)."""
        if epoch < self.epoch:
            return {"moved": self.epoch}, None
        self.epoch = epoch
        if getattr(self.engine, "scratch_grant", None) is None:
            return self._run(op, payload)
        if self._thread is None:
            # The op runs on this thread while a method returns each ask to the gateway and
            # the next (``answer``) hands the engine its answer: Ray runs one method at a
            # time, and no method waits for another.
            self._thread = threading.Thread(target=self._serve, name="difftape-engine",
                                            daemon=True)
            self._thread.start()
            self.engine.ask_scratch = self._ask
        while self._asking:  # an op whose gateway stopped waiting for it (died mid-ask)
            self._answers.put({"refuse": "memory quota: the request is no longer awaited"})
            self._next()
        self._ops.put((op, payload))
        return self._next()

    def answer(self, answer: dict) -> tuple[dict, Any]:
        """The gateway's answer to the running op's ask; the op's next ask or its reply."""
        if not self._asking:
            return {"error": _error_dict(RuntimeError("no op waits for an answer"))}, None
        self._answers.put(answer)
        return self._next()

    def _next(self) -> tuple[dict, Any]:
        event = self._events.get()
        self._asking = "ask" in event[0]
        return event

    def _ask(self, ask: dict) -> dict:
        self._events.put(({"ask": ask}, None))
        return self._answers.get()

    def _serve(self) -> None:
        while True:
            op, payload = self._ops.get()
            self._events.put(self._run(op, payload))

    def _run(self, op: dict, payload: Any) -> tuple[dict, Any]:
        import numpy as np

        try:
            result, out = self.engine.execute(op, payload)
        except Exception as e:  # noqa: BLE001 - every error becomes a reply
            return {"error": _error_dict(e)}, None
        if out is not None:
            out = np.frombuffer(out, dtype=np.uint8)
        return {"ok": result if result is not None else {}}, out

    def shutdown(self) -> dict:
        """The last counters; the engine's threads stop (the gateway kills the actor)."""
        try:
            final = self.engine.execute({"op": "stats"}, None)[0]
        except Exception:  # noqa: BLE001 - an engine without stats
            final = {}
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()
        return final


def _payload_arg(payload):
    """Big payloads as a uint8 array (Ray moves it out of band through the object store)."""
    if payload is None:
        return None
    view = memoryview(payload)
    if view.nbytes < SHM_MIN:
        return bytes(view)
    import numpy as np

    return np.frombuffer(view.cast("B"), dtype=np.uint8)


def _lost_reason(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    first = next((t for t in text if t.strip()), type(err).__name__)
    return f"the session's Ray actor died ({type(err).__name__}: {first.strip()[:300]})"


class RayWorker(EngineWorker):
    """The gateway's handle on one engine actor; calls are serialized like ``Worker``'s."""

    def __init__(self, actor, name: str, resources: dict[str, float]) -> None:
        super().__init__()
        self.actor = actor
        self.name = name
        self.resources = resources
        self.node: str | None = None
        self.pid: int | None = None

    @property
    def address(self) -> str:
        return f"ray:{NAMESPACE}/{self.name}"

    def alive(self) -> bool:
        """False once a call found the actor dead or it was killed (Ray reports a death to
        the next call; asking the cluster on every check would cost a round trip)."""
        return self.gone is None

    def wait_ready(self, timeout: float) -> None:
        ray = _ray()
        try:
            info = ray.get(self.actor.ready.remote(), timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            self.kill()
            raise RuntimeError(f"no node of the cluster started the engine within {timeout:g} s "
                               f"(resources asked: {self.resources})") from None
        except ray.exceptions.RayError as e:
            self.kill()
            raise StartLost(f"the engine actor could not start: {_lost_reason(e)}") from None
        self.node, self.pid = info["node"], info["pid"]
        log.info("engine actor %s started on node %s", self.name, self.node)

    async def call(self, op: dict, payload=None, *, timeout: float) -> tuple[dict, Any]:
        ray = _ray()
        async with self.lock:
            self._admit(op)
            self.current = op.get("op")
            try:
                ref = self.actor.execute.remote(op, _payload_arg(payload), self.epoch)
                reply, out = await asyncio.wait_for(ref, timeout)
                while "ask" in reply:  # the engine needs more of the quota to go on
                    ref = self.actor.answer.remote(self._answer_ask(reply["ask"]))
                    reply, out = await asyncio.wait_for(ref, timeout)
            except TimeoutError:
                raise self._overran(timeout, "Ray actor") from None
            except ray.exceptions.RayTaskError as e:  # the method itself failed: a bug
                raise ProblemError(500, f"engine actor failed: {e}") from None
            except ray.exceptions.RayError as e:  # actor or node died, actor unreachable
                if self.gone is None:
                    self.gone = WorkerGone(_lost_reason(e))
                    self.kill()
                raise self.gone from None
            finally:
                self.current = None
        if "moved" in reply:
            raise WorkerMoved(f"another gateway took the session over (epoch {reply['moved']} "
                              f"> {self.epoch})")
        return self._answer(reply, memoryview(out) if out is not None else None)

    def kill(self) -> None:
        """No restart: a lost session resumes from its save through ``RayWorkerPool``."""
        if self.gone is None:
            self.gone = WorkerGone("the worker was stopped")
        try:
            _ray().kill(self.actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already dead, or the cluster is gone
            pass

    def stop(self, timeout: float = 5.0) -> None:
        ray = _ray()
        if self.gone is None:
            try:
                self._keep_stats(ray.get(self.actor.shutdown.remote(), timeout=timeout))
            except ray.exceptions.RayError:
                pass
        self.gone = self.gone or WorkerGone("the worker was stopped")
        self.kill()


def check_resources(resources: dict[str, float], nodes: list[dict]) -> str | None:
    """Why no alive node could ever hold an actor asking ``resources`` (None if one can)."""
    need = {"CPU": resources.get("cpus", 0.0), "GPU": resources.get("gpus", 0.0)}
    best: dict[str, float] = {"CPU": 0.0, "GPU": 0.0}
    for n in nodes:
        if not n.get("Alive"):
            continue
        have = n.get("Resources", {})
        if all(have.get(k, 0.0) >= v for k, v in need.items()):
            return None
        for k in best:
            best[k] = max(best[k], have.get(k, 0.0))
    return (f"no node of the cluster has {need['CPU']:g} CPUs and {need['GPU']:g} GPUs "
            f"(the largest have {best['CPU']:g} CPUs, {best['GPU']:g} GPUs)")


class RayWorkerPool(EnginePool):
    """Engine actors on the cluster, ``spare`` ready ones of the default resources, as
    ``WorkerPool`` keeps processes."""

    kind = "engine actor"

    def __init__(self, engine_spec: str, engine_kwargs: dict, spare: int,
                 start_timeout: float, *, default_cpus: float, default_gpus: float = 0.0,
                 worker_threads: int) -> None:
        super().__init__(engine_spec, engine_kwargs, spare, start_timeout)
        self.default = {"cpus": float(default_cpus), "gpus": float(default_gpus)}
        self.worker_threads = worker_threads
        self._actor_cls = None
        # The gateway's node, where sessions go first (the module's docstring); None: spread.
        self.home: str | None = own_node()
        self.gateway_id = "g_"  # this gateway's id, and its database's: set by the Service
        self.instance = "0"

    def placement(self, resources: dict[str, float]):
        """Where an actor asking ``resources`` should go: the gateway's node when it could
        ever hold it (spilling elsewhere while it is full: without the spill a soft affinity
        waits for room there), else spread over the cluster's nodes."""
        if self.home is None:
            return "SPREAD"
        ray = _ray()
        home = [n for n in ray.nodes() if n.get("NodeID") == self.home]
        if check_resources(resources, home) is not None:
            return "SPREAD"  # no room there ever (or the node is gone)
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        return NodeAffinitySchedulingStrategy(self.home, soft=True, _spill_on_unavailable=True)

    def _spawn(self, resources: dict[str, float]) -> RayWorker:
        ray = _ray()
        if self._actor_cls is None:
            self._actor_cls = ray.remote(EngineActor)
        cpus = resources["cpus"]
        kwargs = dict(self.engine_kwargs)
        # As many program threads as CPUs reserved: more would take other actors' cores.
        kwargs["num_threads"] = self.worker_threads or max(1, math.floor(cpus))
        # The database's id and the starting gateway's in the name: what ``reap`` needs once
        # that gateway is gone (and only for this database's gateways).
        name = f"difftape-{self.instance}-{self.gateway_id}-{secrets.token_hex(8)}"
        actor = self._actor_cls.options(
            name=name, namespace=NAMESPACE, num_cpus=cpus, num_gpus=resources["gpus"],
            max_restarts=0, max_task_retries=0,
            scheduling_strategy=self.placement(resources),
            # It outlives this gateway: any gateway of the database reaches it by name.
            lifetime="detached",
        ).remote(self.engine_spec, kwargs)
        return RayWorker(actor, name, resources)

    def check(self, asked: dict[str, float] | None) -> None:
        """422 when no node of the cluster could ever place these resources."""
        why = check_resources(self.resources(asked), _ray().nodes())
        if why is not None:
            raise ProblemError(422, f"the session's resources cannot be placed: {why}")

    async def attach(self, address: str, resources: dict[str, float] | None) -> RayWorker:
        """A handle on the running actor at ``address`` (``ray:<namespace>/<name>``), which
        another gateway (or this one, before a restart) started; WorkerGone if it is no
        more (killed, or its node lost)."""
        namespace, _, name = address.removeprefix("ray:").partition("/")
        ray = _ray()

        def find():
            try:
                return ray.get_actor(name, namespace=namespace)
            except ValueError:
                return None

        actor = await asyncio.get_running_loop().run_in_executor(_executor, find)
        if actor is None:
            raise WorkerGone(f"the session's Ray actor {name} is gone (killed, or its node "
                             "was lost)")
        return RayWorker(actor, name, self.resources(resources))

    def reap(self, gateway: str, live_gateways: set[str], in_use: set[str]) -> list[str]:
        """Kill the engine actors that gateways of this database no longer alive started
        and that no session names (spares, or a session's start cut short by its gateway's
        death): detached actors outlive the gateway that started them. Actors of another
        database's gateways on the same cluster are not this one's to judge. The names
        killed."""
        ray = _ray()
        killed = []
        for a in ray.util.list_named_actors(all_namespaces=True):
            name = a["name"]
            parts = name.split("-")
            if (a["namespace"] != NAMESPACE or len(parts) != 4 or parts[1] != self.instance
                    or parts[2] in (gateway, *live_gateways) or name in in_use):
                continue
            try:
                ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
                killed.append(name)
            except Exception:  # noqa: BLE001 - gone meanwhile
                pass
        if killed:
            log.info("stopped %d engine actors left by stopped gateways", len(killed))
        return killed


__all__ = ["EngineActor", "RayWorker", "RayWorkerPool", "check_resources", "connect", "own_node"]
