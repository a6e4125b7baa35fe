"""``ti.tools.PLYWriter``: NumPy arrays of per-vertex and per-face values written as a PLY mesh
or point cloud (the format of Stanford's Polygon File Format; Houdini, Blender and MeshLab
read it), in binary (this machine's byte order) or ASCII, one file or a numbered series.

The API is Taichi's: channels are added by name with a PLY type, the file lists them in the
order they were added. As in Taichi, a channel of a type PLY does not have is skipped with a
warning, a repeated name is warned about, and a 2-D array of k columns is k channels
``name_1 ... name_k``.
"""

from __future__ import annotations

import sys
import warnings

import numpy as np

from ..errors import ShapeError

#: PLY's scalar types and the NumPy types their values are written as.
PLY_TYPES = {"char": np.int8, "uchar": np.uint8, "short": np.int16, "ushort": np.uint16,
             "int": np.int32, "uint": np.uint32, "float": np.float32, "double": np.float64}


class PLYWriter:
    """A mesh of ``num_vertices`` vertices and ``num_faces`` faces (``face_type`` "tri" or
    "quad"); ``comment`` goes in the header."""

    def __init__(self, num_vertices: int, num_faces: int = 0, face_type: str = "tri",
                 comment: str = "created by PLYWriter") -> None:
        if num_vertices <= 0 or num_faces < 0:
            raise ShapeError(f"PLYWriter needs num_vertices > 0 and num_faces >= 0, got "
                             f"{num_vertices} and {num_faces}")
        if face_type not in ("tri", "quad"):
            raise ValueError(f"PLYWriter: face_type is 'tri' or 'quad', got {face_type!r}")
        self.num_vertices = num_vertices
        self.num_faces = num_faces
        self.face_type = face_type
        self.comment = comment
        self.corners = 3 if face_type == "tri" else 4
        self.face_indices = np.full((num_faces, self.corners), -1, np.int32)
        self.vertex_channels: list[tuple[str, str, np.ndarray]] = []
        self.face_channels: list[tuple[str, str, np.ndarray]] = []

    # ------------------------------------------------------------------ channels
    def _add(self, channels: list, count: int, what: str, key: str, data_type: str,
             data) -> None:
        if data_type not in PLY_TYPES:
            warnings.warn(f"PLYWriter: unknown PLY type {data_type!r} of {what} channel "
                          f"{key!r}: the channel is skipped (PLY types: "
                          f"{', '.join(PLY_TYPES)})", stacklevel=3)
            return
        data = np.asarray(data)
        if data.size % count or data.ndim > 2 or data.ndim == 1 and data.size != count:
            plural = "vertices" if what == "vertex" else "faces"
            raise ShapeError(f"PLYWriter: {what} channel {key!r} has {data.size} values for "
                             f"{count} {plural}")
        columns = data.reshape(count, -1)
        keys = [key] if data.ndim <= 1 else [f"{key}_{i + 1}" for i in range(columns.shape[1])]
        for i, k in enumerate(keys):
            if any(k == name for name, _, _ in channels):
                warnings.warn(f"PLYWriter: {what} channel {k!r} is added twice", stacklevel=3)
            channels.append((k, data_type, columns[:, i].astype(PLY_TYPES[data_type])))

    def add_vertex_channel(self, key: str, data_type: str, data) -> None:
        """Values ``data`` (one per vertex, or a 2-D array: a channel per column) as property
        ``key`` of PLY type ``data_type``."""
        self._add(self.vertex_channels, self.num_vertices, "vertex", key, data_type, data)

    def add_face_channel(self, key: str, data_type: str, data) -> None:
        """As :meth:`add_vertex_channel`, one value per face."""
        self._add(self.face_channels, self.num_faces, "face", key, data_type, data)

    def _add_floats(self, keys: tuple[str, ...], arrays: tuple) -> None:
        for k, a in zip(keys, arrays, strict=True):
            self.add_vertex_channel(k, "float", a)

    def add_vertex_pos(self, x, y, z) -> None:
        self._add_floats(("x", "y", "z"), (x, y, z))

    def add_vertex_normal(self, nx, ny, nz) -> None:
        self._add_floats(("nx", "ny", "nz"), (nx, ny, nz))

    def add_vertex_vel(self, vx, vy, vz) -> None:
        self._add_floats(("vx", "vy", "vz"), (vx, vy, vz))

    def add_vertex_color(self, r, g, b) -> None:
        self._add_floats(("red", "green", "blue"), (r, g, b))

    def add_vertex_alpha(self, alpha) -> None:
        self._add_floats(("Alpha",), (alpha,))

    def add_vertex_rgba(self, r, g, b, a) -> None:
        self._add_floats(("red", "green", "blue", "Alpha"), (r, g, b, a))

    def add_vertex_id(self) -> None:
        self.add_vertex_channel("id", "int", np.arange(self.num_vertices))

    def add_vertex_piece(self, piece) -> None:
        self.add_vertex_channel("piece", "int", piece)

    def add_face_id(self) -> None:
        self.add_face_channel("id", "int", np.arange(self.num_faces))

    def add_face_piece(self, piece) -> None:
        self.add_face_channel("piece", "int", piece)

    def add_faces(self, indices) -> None:
        """The vertex indices of every face (``num_faces`` x 3 or 4 values)."""
        indices = np.asarray(indices)
        if indices.size != self.num_faces * self.corners:
            raise ShapeError(f"PLYWriter: {self.num_faces} {self.face_type} faces need "
                             f"{self.num_faces * self.corners} vertex indices, got "
                             f"{indices.size}")
        self.face_indices = indices.reshape(self.num_faces, self.corners).astype(np.int32)

    # ------------------------------------------------------------------ writing
    def _check(self) -> None:
        names = {name for name, _, _ in self.vertex_channels}
        if not {"x", "y", "z"} <= names:
            raise ShapeError("PLYWriter: the vertex positions are missing: call "
                             "add_vertex_pos(x, y, z) before exporting")
        if self.num_faces and ((self.face_indices < 0).any()
                               or (self.face_indices >= self.num_vertices).any()):
            raise ShapeError(f"PLYWriter: a face refers to a vertex outside 0..."
                             f"{self.num_vertices - 1} (or add_faces was not called)")

    def _header(self, fmt: str) -> str:
        lines = ["ply", f"format {fmt} 1.0", f"comment {self.comment}",
                 f"element vertex {self.num_vertices}"]
        lines += [f"property {t} {k}" for k, t, _ in self.vertex_channels]
        if self.num_faces:
            lines += [f"element face {self.num_faces}", "property list uchar int vertex_indices"]
            lines += [f"property {t} {k}" for k, t, _ in self.face_channels]
        return "\n".join(lines + ["end_header"]) + "\n"

    @staticmethod
    def _records(columns: list[tuple[str, np.ndarray]], count: int) -> np.ndarray:
        """The rows of an element as one packed structured array (the binary layout)."""
        dtype = np.dtype([(f"f{i}", a.dtype) for i, (_, a) in enumerate(columns)])
        out = np.empty(count, dtype)
        for i, (_, a) in enumerate(columns):
            out[f"f{i}"] = a
        return out

    def export(self, path: str) -> None:
        """Write the binary PLY file ``path``."""
        self._check()
        vertices = self._records([(k, a) for k, _, a in self.vertex_channels], self.num_vertices)
        faces = self._records(
            [("n", np.full(self.num_faces, self.corners, np.uint8))]
            + [(f"v{j}", self.face_indices[:, j]) for j in range(self.corners)]
            + [(k, a) for k, _, a in self.face_channels], self.num_faces)
        with open(path, "wb") as f:
            f.write(self._header(f"binary_{sys.byteorder}_endian").encode())
            f.write(vertices.tobytes())
            if self.num_faces:
                f.write(faces.tobytes())

    def export_ascii(self, path: str) -> None:
        """Write the ASCII PLY file ``path``: a line per vertex, then a line per face."""
        self._check()
        lines = [" ".join(str(a[i]) for _, _, a in self.vertex_channels) + " "
                 for i in range(self.num_vertices)]
        for i in range(self.num_faces):
            values = [str(self.corners), *map(str, self.face_indices[i])]
            values += [str(a[i]) for _, _, a in self.face_channels]
            lines.append(" ".join(values) + " ")
        with open(path, "w") as f:
            f.write(self._header("ascii") + "".join(line + "\n" for line in lines))

    @staticmethod
    def _frame_path(series_num: int, path: str) -> str:
        base = path[:-4] if path.endswith(".ply") else path
        return f"{base}_{series_num:06d}.ply"

    def export_frame(self, series_num: int, path: str) -> None:
        """Binary file number ``series_num`` of a series: ``path`` + ``_000012.ply``."""
        self.export(self._frame_path(series_num, path))

    def export_frame_ascii(self, series_num: int, path: str) -> None:
        """As :meth:`export_frame`, in ASCII."""
        self.export_ascii(self._frame_path(series_num, path))


__all__ = ["PLYWriter"]
