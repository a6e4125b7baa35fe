"""``ti.tools.PLYWriter``: meshes written as PLY files, read back here with a small PLY reader
(the format's header, then binary rows or ASCII lines) and compared with what was written.
The behaviours are Taichi's (these tests pass on Taichi 1.7.4 with DIFFTAPE_TEST_PEER=taichi)
except where marked."""

import sys

import numpy as np
import pytest

TYPES = {"char": "i1", "uchar": "u1", "short": "i2", "ushort": "u2", "int": "i4", "uint": "u4",
         "float": "f4", "double": "f8"}


def read_ply(path):
    """(format, comment, {element: (count, [(property, numpy type)])}, {element: rows})."""
    data = open(path, "rb").read()
    end = data.index(b"end_header\n") + len(b"end_header\n")
    header = data[:end].decode().splitlines()
    assert header[0] == "ply"
    fmt, comment, elements, order = None, None, {}, []
    for line in header[1:-1]:
        words = line.split()
        if words[0] == "format":
            fmt = words[1]
        elif words[0] == "comment":
            comment = line[len("comment "):]
        elif words[0] == "element":
            elements[words[1]] = (int(words[2]), [])
            order.append(words[1])
        elif words[0] == "property" and words[1] == "list":  # a face's vertex count, indices
            elements[order[-1]][1].append((words[4], (words[2], words[3])))
        else:
            elements[order[-1]][1].append((words[2], words[1]))
    rows = {}
    if fmt == "ascii":
        lines = data[end:].decode().splitlines()
        for name in order:
            count, _ = elements[name]
            rows[name] = [[float(v) for v in ln.split()] for ln in lines[:count]]
            lines = lines[count:]
        return fmt, comment, elements, rows
    pos = end
    endian = "<" if fmt == "binary_little_endian" else ">"
    for name in order:
        count, props = elements[name]
        fields = []
        for key, t in props:
            if isinstance(t, tuple):  # fixed length here: read the count, then the indices
                n = data[pos + 0]
                fields += [("n", "u1"), (key, endian + TYPES[t[1]], (n,))]
            else:
                fields.append((key, endian + TYPES[t]))
        dtype = np.dtype(fields)
        rows[name] = np.frombuffer(data, dtype, count, pos)
        pos += dtype.itemsize * count
    assert pos == len(data)
    return fmt, comment, elements, rows


def _mesh(ti):
    rng = np.random.default_rng(3)
    pos = rng.random((6, 3))
    quads = np.array([[0, 1, 2, 3], [2, 3, 4, 5]])
    extra = rng.random((6, 2))
    writer = ti.tools.PLYWriter(num_vertices=6, num_faces=2, face_type="quad",
                                comment="test mesh")
    writer.add_vertex_pos(pos[:, 0], pos[:, 1], pos[:, 2])
    writer.add_faces(quads)
    writer.add_vertex_channel("extra", "double", extra)
    writer.add_vertex_id()
    writer.add_face_channel("weight", "float", np.array([0.5, 0.25]))
    return writer, pos, quads, extra


def test_binary_ply_holds_the_mesh_and_its_channels(ti, tmp_path):
    writer, pos, quads, extra = _mesh(ti)
    writer.export(str(tmp_path / "m.ply"))
    fmt, comment, elements, rows = read_ply(tmp_path / "m.ply")
    assert fmt == f"binary_{sys.byteorder}_endian" and comment == "test mesh"
    assert elements["vertex"] == (6, [("x", "float"), ("y", "float"), ("z", "float"),
                                      ("extra_1", "double"), ("extra_2", "double"),
                                      ("id", "int")])
    assert elements["face"] == (2, [("vertex_indices", ("uchar", "int")),
                                    ("weight", "float")])
    v, f = rows["vertex"], rows["face"]
    np.testing.assert_array_equal(np.stack([v["x"], v["y"], v["z"]], 1),
                                  pos.astype(np.float32))
    np.testing.assert_array_equal(np.stack([v["extra_1"], v["extra_2"]], 1), extra)
    np.testing.assert_array_equal(v["id"], np.arange(6))
    np.testing.assert_array_equal(f["n"], [4, 4])
    np.testing.assert_array_equal(f["vertex_indices"], quads)
    np.testing.assert_array_equal(f["weight"], [0.5, 0.25])


def test_ascii_ply_series_holds_the_same_values(ti, tmp_path):
    writer, pos, quads, extra = _mesh(ti)
    writer.export_frame_ascii(7, str(tmp_path / "s.ply"))
    fmt, _, elements, rows = read_ply(tmp_path / "s_000007.ply")
    assert fmt == "ascii"
    v = np.array(rows["vertex"])
    np.testing.assert_allclose(v[:, :3], pos.astype(np.float32), rtol=1e-6)
    np.testing.assert_allclose(v[:, 3:5], extra, rtol=1e-15)
    np.testing.assert_array_equal(v[:, 5], np.arange(6))
    np.testing.assert_array_equal(np.array(rows["face"]), [[4, 0, 1, 2, 3, 0.5],
                                                           [4, 2, 3, 4, 5, 0.25]])


def test_point_cloud_without_faces(ti, tmp_path):
    writer = ti.tools.PLYWriter(num_vertices=3)
    writer.add_vertex_pos(np.arange(3.0), np.zeros(3), np.ones(3))
    writer.add_vertex_rgba(np.ones(3), np.zeros(3), np.zeros(3), np.full(3, 0.5))
    writer.export_frame(2, str(tmp_path / "p"))
    _, _, elements, rows = read_ply(tmp_path / "p_000002.ply")
    assert list(elements) == ["vertex"]
    assert [k for k, _ in elements["vertex"][1]] == ["x", "y", "z", "red", "green", "blue",
                                                      "Alpha"]
    np.testing.assert_array_equal(rows["vertex"]["x"], [0, 1, 2])
    np.testing.assert_array_equal(rows["vertex"]["Alpha"], [0.5] * 3)


@pytest.mark.difftape_only  # Taichi prints a line and skips; difftape warns and skips
def test_a_channel_of_an_unknown_type_is_skipped_with_a_warning(ti, tmp_path):
    writer = ti.tools.PLYWriter(num_vertices=2)
    with pytest.warns(UserWarning, match="unknown PLY type 'foo'.*skipped"):
        writer.add_vertex_channel("k", "foo", np.zeros(2))
    writer.add_vertex_pos(np.zeros(2), np.zeros(2), np.zeros(2))
    writer.export(str(tmp_path / "w.ply"))
    assert [k for k, _ in read_ply(tmp_path / "w.ply")[2]["vertex"][1]] == ["x", "y", "z"]


@pytest.mark.difftape_only  # Taichi fails an assert
def test_a_channel_of_the_wrong_length_and_a_mesh_without_positions_are_refused(ti, tmp_path):
    writer = ti.tools.PLYWriter(num_vertices=4, num_faces=1)
    with pytest.raises(ti.ShapeError, match="3 values for 4 vertices"):
        writer.add_vertex_channel("k", "float", np.zeros(3))
    with pytest.raises(ti.ShapeError, match="vertex positions are missing"):
        writer.export(str(tmp_path / "w.ply"))
