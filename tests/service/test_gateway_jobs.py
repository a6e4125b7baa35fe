"""Jobs: 202 + id, status, SSE progress, cancel, result, idempotent resubmission, fairness."""

import json
import time

import numpy as np

from .conftest import from_npy, npy, problem, setup_session


def wait_job(client, job_id, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = client.get(f"/v1/jobs/{job_id}").json()
        if info["state"] in ("succeeded", "failed", "cancelled"):
            return info
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} did not finish: {info}")


def test_job_runs_once_and_resubmission_is_idempotent(alice, session, kernels):
    ids = setup_session(alice, session, kernels, "square_sum")
    x = np.arange(kernels.n, dtype=np.float32)
    alice.put(f"/v1/sessions/{session}/fields/{kernels.x.id}/data", content=npy(x))
    body = {"ops": [{"op": "launch", "kernel_id": ids["square_sum"]}],
            "job_id": "accumulate-1"}
    first = alice.post(f"/v1/sessions/{session}/jobs", json=body)
    assert first.status_code == 202, first.text
    assert first.json()["job_id"] == "accumulate-1"
    assert first.headers["location"] == "/v1/jobs/accumulate-1"
    for _ in range(3):  # a retrying client
        again = alice.post(f"/v1/sessions/{session}/jobs", json=body)
        assert again.status_code == 202 and again.json()["job_id"] == "accumulate-1"
    assert wait_job(alice, "accumulate-1")["state"] == "succeeded"
    alice.post(f"/v1/sessions/{session}/jobs", json=body)
    time.sleep(0.3)
    # square_sum adds into loss: run once means loss == sum(x^2), not a multiple of it.
    loss = from_npy(alice.get(f"/v1/sessions/{session}/fields/{kernels.loss.id}/data").content)
    assert float(loss) == float((x * x).sum())
    r = alice.get("/v1/jobs/accumulate-1/result")
    assert r.status_code == 200 and r.json() == {"job_id": "accumulate-1",
                                                 "results": [{"result": None}]}
    # The same id with other ops is a conflict, not a silent no-op.
    other = {"ops": [{"op": "clear_grads"}], "job_id": "accumulate-1"}
    problem(alice.post(f"/v1/sessions/{session}/jobs", json=other), 409)


def test_cancel_running_and_queued_jobs(alice, session, kernels):
    ids = setup_session(alice, session, kernels, "spin")
    spin = {"op": "launch", "kernel_id": ids["spin"], "args": [100_000_000]}  # ~0.3 s each
    r = alice.post(f"/v1/sessions/{session}/jobs", json={"ops": [spin] * 40})
    long_id = r.json()["job_id"]
    assert r.json()["state"] in ("queued", "running")
    queued = alice.post(f"/v1/sessions/{session}/jobs",
                        json={"ops": [spin], "job_id": "never-runs"}).json()
    deadline = time.monotonic() + 30
    while alice.get(f"/v1/jobs/{long_id}").json()["done"] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert queued["state"] == "queued"
    assert alice.post("/v1/jobs/never-runs/cancel").json()["state"] == "cancelled"
    alice.post(f"/v1/jobs/{long_id}/cancel")
    info = wait_job(alice, long_id)
    assert info["state"] == "cancelled" and 1 <= info["done"] < 40
    never = alice.get("/v1/jobs/never-runs").json()
    assert never["state"] == "cancelled" and never["done"] == 0 and never["started"] is None
    problem(alice.get(f"/v1/jobs/{long_id}/result"), 409)
    # Cancelling a finished job changes nothing.
    assert alice.post(f"/v1/jobs/{long_id}/cancel").json()["state"] == "cancelled"


def test_progress_events(alice, session, kernels):
    ids = setup_session(alice, session, kernels, "spin")
    # ~0.25 s per op: time enough for each change to reach the stream even on a busy box.
    spin = {"op": "launch", "kernel_id": ids["spin"], "args": [100_000_000]}
    job = alice.post(f"/v1/sessions/{session}/jobs", json={"ops": [spin] * 5}).json()
    events = []
    with alice.stream("GET", f"/v1/jobs/{job['job_id']}/events") as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        kind = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                events.append((kind, json.loads(line[6:])))
                if kind == "end":
                    break
    assert events[-1][0] == "end" and events[-1][1]["state"] == "succeeded"
    assert events[-1][1]["done"] == 5
    dones = [e[1]["done"] for e in events]
    assert dones == sorted(dones) and len(set(dones)) >= 3  # it did report progress


def test_failed_job_result_is_its_problem(alice, session, kernels):
    ids = setup_session(alice, session, kernels, "poke")
    ops = [{"op": "launch", "kernel_id": ids["poke"], "args": [0]},
           {"op": "launch", "kernel_id": ids["poke"], "args": [10**6]}]
    job = alice.post(f"/v1/sessions/{session}/jobs", json={"ops": ops}).json()
    info = wait_job(alice, job["job_id"])
    assert info["state"] == "failed" and info["done"] == 1
    assert info["problem"]["difftape_error"] == "IndexOutOfRangeError"  # a KernelAssertionError
    problem(alice.get(f"/v1/jobs/{job['job_id']}/result"), 422, "IndexOutOfRangeError")


def test_fair_share_is_round_robin_over_users(db_target):
    """The scheduler's order: one job per user in turn, each user's jobs in submission
    order, however many one user queued first."""
    import asyncio
    from types import SimpleNamespace

    from difftape.server.db import Database
    from difftape.server.jobs import JobScheduler
    from difftape.server.metrics import Metrics

    async def order():
        db = Database(db_target)
        users = {}
        for name in "abc":
            db.create_user(name)
            users[name] = db.execute("SELECT id, name FROM users WHERE name = ?", (name,))[0]
        from difftape.server.db import User

        settings = SimpleNamespace(arch="cpu", quota_job_seconds=100, job_concurrency=1)
        sched = JobScheduler(settings, db, SimpleNamespace(row=lambda u, s: None), Metrics())
        for name, n in (("a", 4), ("b", 2), ("c", 1)):
            u = User(users[name]["id"], name)
            for k in range(n):
                await sched.submit(u, "s", [{"op": "clear_grads"}], f"{name}{k}")
        depth = sched.metrics.queue_depth.labels("cpu")._value.get()
        out = []
        while (job := sched._next()) is not None:
            out.append(job.id)
        return depth, out

    depth, out = asyncio.run(order())
    assert depth == 7
    assert out == ["a0", "b0", "c0", "a1", "b1", "a2", "a3"]
