"""Restart: compiled code survives in the shared cache, sessions survive a graceful stop."""

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from .conftest import from_npy, npy, setup_session, start_server


def metric(client, name: str, labels: dict | None = None) -> float:
    text = client.get("/metrics").text
    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in (labels or {}).items()):
                total += s.value
    return total


def test_restart_with_warm_cache(tmp_path, kernels):
    data = tmp_path / "data"
    first = start_server(data, users=("alice",))
    try:
        with first.client() as c:
            sid = c.post("/v1/sessions", json={}).json()["session_id"]
            ids = setup_session(c, sid, kernels, "double")
            x = np.arange(kernels.n, dtype=np.float32) * 3
            c.put(f"/v1/sessions/{sid}/fields/{kernels.x.id}/data", content=npy(x))
            assert c.post(f"/v1/sessions/{sid}/kernels/{ids['double']}/launch",
                          json={}).status_code == 200
            assert metric(c, "difftape_compile_cache_misses_total") >= 1
            assert metric(c, "difftape_compile_cache_hits_total") == 0
    finally:
        first.stop()
    assert list((data / "cache").rglob("*.o")), "nothing was cached on disk"
    assert list((data / "sessions").glob(f"{sid}-*.npz")), "the stop did not save the session"

    second = start_server(data, users=(), tokens=first.tokens)
    try:
        with second.client() as c:
            assert c.get(f"/v1/sessions/{sid}").json()["state"] == "culled"
            # A new session runs the known kernel without LLVM: a cache hit, no miss.
            fresh = c.post("/v1/sessions", json={}).json()["session_id"]
            ids2 = setup_session(c, fresh, kernels, "double")
            assert ids2 == ids  # the kernel id is the IR's fingerprint
            assert c.post(f"/v1/sessions/{fresh}/kernels/{ids['double']}/launch",
                          json={}).status_code == 200
            assert metric(c, "difftape_compile_cache_hits_total") >= 1
            assert metric(c, "difftape_compile_cache_misses_total") == 0
            # The saved session resumes with its data, its kernel runs from the cache.
            assert c.post(f"/v1/sessions/{sid}/kernels/{ids['double']}/launch",
                          json={}).status_code == 200
            y = from_npy(c.get(f"/v1/sessions/{sid}/fields/{kernels.y.id}/data").content)
            np.testing.assert_array_equal(y, 2 * x)
            assert metric(c, "difftape_compile_cache_misses_total") == 0
    finally:
        second.stop()


def test_metrics_content(service, alice, session, kernels):
    ids = setup_session(alice, session, kernels, "double")
    before = metric(alice, "difftape_kernel_launches_total", {"variant": "primal"})
    moved = metric(alice, "difftape_bytes_moved_total", {"direction": "in"})
    for _ in range(3):
        alice.post(f"/v1/sessions/{session}/kernels/{ids['double']}/launch", json={})
    alice.put(f"/v1/sessions/{session}/fields/{kernels.x.id}/data",
              content=npy(np.ones(kernels.n, np.float32)))
    text = alice.get("/metrics").text
    for name in ("difftape_http_request_duration_seconds_bucket",
                 "difftape_compile_cache_hits_total", "difftape_compile_cache_misses_total",
                 "difftape_compile_seconds_total", "difftape_job_queue_depth",
                 "difftape_field_bytes", "difftape_sessions_running",
                 "difftape_bytes_moved_total", "difftape_workers_lost_total"):
        assert name in text, name
    assert metric(alice, "difftape_kernel_launches_total", {"variant": "primal"}) == before + 3
    assert metric(alice, "difftape_bytes_moved_total", {"direction": "in"}) == \
        moved + 4 * kernels.n
    route = "/v1/sessions/{sid}/kernels/{kernel_id}/launch"
    assert metric(alice, "difftape_http_request_duration_seconds_count",
                  {"route": route, "status": "200"}) >= 3
    # Server-wide figures only (no per-session labels: see test_metrics_show_no_session_ids).
    assert metric(alice, "difftape_field_bytes") >= \
        sum(4 * kernels.n * 2 if f.shape else 4 * 2 for f in kernels.fields.values())
    assert session not in text


def test_openapi_documents_binary_bodies(service, alice):
    spec = alice.get("/openapi.json").json()
    put = spec["paths"]["/v1/sessions/{sid}/fields/{fid}/{role}"]["put"]
    content = put["requestBody"]["content"]
    assert content["application/x-npy"]["schema"]["format"] == "binary"
    assert "application/octet-stream" in content
    get = spec["paths"]["/v1/sessions/{sid}/fields/{fid}/{role}"]["get"]
    assert "application/x-npy" in get["responses"]["200"]["content"]
    assert "HTTPBearer" in spec["components"]["securitySchemes"]
    assert alice.get("/docs").status_code == 200
