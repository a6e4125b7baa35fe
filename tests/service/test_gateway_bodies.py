"""Array bodies: .npy and raw bytes, read without pickle, sizes checked; the body limit."""

import io

import numpy as np

from .conftest import from_npy, npy, problem


def _path(session, kernels, role="data"):
    return f"/v1/sessions/{session}/fields/{kernels.x.id}/{role}"


def _create(alice, session, kernels):
    r = alice.post(f"/v1/sessions/{session}/batch", json={"ops": kernels.create_ops()})
    assert r.status_code == 200, r.text


def test_npy_and_raw_round_trips(alice, session, kernels):
    _create(alice, session, kernels)
    x = np.linspace(-1, 1, kernels.n, dtype=np.float32)
    assert alice.put(_path(session, kernels), content=npy(x),
                     headers={"Content-Type": "application/x-npy"}).status_code == 204
    r = alice.get(_path(session, kernels))
    assert r.headers["content-type"] == "application/x-npy"
    np.testing.assert_array_equal(from_npy(r.content), x)
    # Raw bytes into .grad; read back raw.
    g = np.arange(kernels.n, dtype=np.float32)
    r = alice.put(_path(session, kernels, "grad"), content=g.tobytes(),
                  headers={"Content-Type": "application/octet-stream", "X-Dtype": "float32",
                           "X-Shape": str(kernels.n)})
    assert r.status_code == 204, r.text
    r = alice.get(_path(session, kernels, "grad"),
                  headers={"Accept": "application/octet-stream"})
    assert r.headers["x-dtype"] == "float32" and r.headers["x-shape"] == str(kernels.n)
    np.testing.assert_array_equal(np.frombuffer(r.content, np.float32), g)
    # Big-endian f64 is converted (values, not bytes, are what a field holds).
    be = np.arange(kernels.n, dtype=">f8") / 4
    assert alice.put(_path(session, kernels), content=npy(be)).status_code == 204
    np.testing.assert_array_equal(from_npy(alice.get(_path(session, kernels)).content),
                                  be.astype(np.float32))


def test_pickle_bearing_npy_is_refused(alice, session, kernels):
    _create(alice, session, kernels)
    evil = np.empty(kernels.n, dtype=object)
    evil[:] = [{"a": i} for i in range(kernels.n)]
    body = npy(evil)  # np.save pickles object arrays
    assert b"pickle" not in body[:10] and len(body) > 100
    r = alice.put(_path(session, kernels), content=body,
                  headers={"Content-Type": "application/x-npy"})
    assert "object" in problem(r, 400)["detail"]
    structured = np.zeros(kernels.n, dtype=[("a", "f4"), ("b", "i4")])
    problem(alice.put(_path(session, kernels), content=npy(structured)), 400)
    problem(alice.put(_path(session, kernels), content=b"\x93NUMPY\x01\x00garbage"), 400)
    problem(alice.put(_path(session, kernels), content=b"not an npy file at all"), 400)


def test_truncated_and_padded_bodies_are_400(alice, session, kernels):
    _create(alice, session, kernels)
    body = npy(np.ones(kernels.n, np.float32))
    assert "truncated" in problem(alice.put(_path(session, kernels), content=body[:-3]),
                                  400)["detail"]
    problem(alice.put(_path(session, kernels), content=body + b"\0\0\0\0"), 400)
    problem(alice.put(_path(session, kernels), content=body[:20]), 400)
    raw = {"Content-Type": "application/octet-stream", "X-Dtype": "f32",
           "X-Shape": str(kernels.n)}
    problem(alice.put(_path(session, kernels), content=b"\0" * (4 * kernels.n - 1),
                      headers=raw), 400)
    problem(alice.put(_path(session, kernels), content=b"\0" * 8,
                      headers={**raw, "X-Dtype": "object"}), 400)
    problem(alice.put(_path(session, kernels), content=b"\0" * 8,
                      headers={**raw, "X-Shape": "two"}), 400)
    # Nothing was written by any of these.
    np.testing.assert_array_equal(from_npy(alice.get(_path(session, kernels)).content),
                                  np.zeros(kernels.n, np.float32))


def test_wrong_shape_is_a_shape_error(alice, session, kernels):
    _create(alice, session, kernels)
    r = alice.put(_path(session, kernels), content=npy(np.ones(3, np.float32)))
    problem(r, 422, "ShapeError")


def test_unsupported_content_type_is_415(alice, session, kernels):
    _create(alice, session, kernels)
    problem(alice.put(_path(session, kernels), content=b"[1, 2]",
                      headers={"Content-Type": "application/json"}), 415)


def test_body_limit(limited):
    """413 from Content-Length, and from the bytes actually received when the body is
    chunked (no Content-Length to trust)."""
    with limited.client("bob") as c:
        sid = c.post("/v1/sessions", json={}).json()["session_id"]
        try:
            path = f"/v1/sessions/{sid}/fields/1/data"
            big = b"\0" * ((1 << 20) + 1)
            problem(c.put(path, content=big), 413)

            def chunks():
                # A header promising more than the limit: refused from the header alone.
                yield npy(np.zeros(300_000, np.float32))[:128]
                for _ in range(20):
                    yield b"\0" * (64 * 1024)

            r = c.put(path, content=chunks(), headers={"Content-Type": "application/x-npy"})
            assert "content-length" not in r.request.headers  # streamed: only bytes count
            problem(r, 413)
            # JSON bodies too (FastAPI reads them through the same limited stream).
            ops = [{"op": "clear_grads"}] * 60000

            def json_chunks():
                import json

                text = json.dumps({"ops": ops}).encode()
                for i in range(0, len(text), 65536):
                    yield text[i:i + 65536]

            r = c.post(f"/v1/sessions/{sid}/batch", content=json_chunks(),
                       headers={"Content-Type": "application/json"})
            problem(r, 413)
            # JSON has its own, smaller limit (256 KiB here); an array body of that size
            # is fine.
            problem(c.post(f"/v1/sessions/{sid}/kernels",
                           json={"ir": {"name": "x" * (300 << 10)}}), 413)
            r = c.put(path, content=b"\0" * (300 << 10),
                      headers={"Content-Type": "application/octet-stream", "X-Dtype": "u8",
                               "X-Shape": str(300 << 10)})
            assert r.status_code != 413, r.text
            # The server still answers normally afterwards.
            assert c.get(f"/v1/sessions/{sid}").status_code == 200
        finally:
            c.delete(f"/v1/sessions/{sid}")


def test_npy_is_read_without_pickle_even_if_asked(monkeypatch):
    """The parser never calls np.load (which could be asked to unpickle)."""
    from difftape.server import npyio

    def boom(*a, **k):
        raise AssertionError("np.load must not be used on request bodies")

    monkeypatch.setattr(np, "load", boom)
    f = io.BytesIO()
    np.save(f, np.arange(6, dtype=np.int32).reshape(2, 3))
    data, dtype, shape = npyio.read_npy(f.getvalue())
    assert (dtype, shape) == ("int32", [2, 3])
    assert bytes(data) == np.arange(6, dtype=np.int32).tobytes()
    f = io.BytesIO()
    np.save(f, np.asfortranarray(np.arange(6, dtype=np.int16).reshape(2, 3)))
    data, dtype, shape = npyio.read_npy(f.getvalue())
    assert bytes(data) == np.arange(6, dtype=np.int16).tobytes()


def test_large_arrays_round_trip_exactly(alice, session):
    """Field data from 64 KiB on goes through the worker's shared mapping, which grows on
    demand from 1 MiB: sizes across that range, both directions, both body formats."""
    rng = np.random.default_rng(0)
    for fid, n in ((101, 20_000), (102, 1 << 20), (103, 3 << 20), (104, 70_000)):
        r = alice.post(f"/v1/sessions/{session}/fields",
                       json={"id": fid, "dtype": "f32", "shape": [n], "needs_grad": True})
        assert r.status_code == 201, r.text
        x = rng.standard_normal(n).astype(np.float32)
        g = rng.standard_normal(n).astype(np.float32)
        path = f"/v1/sessions/{session}/fields/{fid}"
        assert alice.put(f"{path}/data", content=npy(x)).status_code == 204
        assert alice.put(f"{path}/grad", content=g.tobytes(),
                         headers={"Content-Type": "application/octet-stream",
                                  "X-Dtype": "float32", "X-Shape": str(n)}).status_code == 204
        back = from_npy(alice.get(f"{path}/data").content)
        assert back.tobytes() == x.tobytes()
        raw = alice.get(f"{path}/grad", headers={"Accept": "application/octet-stream"})
        assert raw.content == g.tobytes()
