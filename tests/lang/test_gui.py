"""``ti.GUI`` headless and ``ti.tools``' image files: the pixels written are Taichi's.

Taichi's GUI keeps an RGBA float32 canvas ``img[x, y]`` (``x`` right, ``y`` up). ``set_image``
copies a picture in (unsigned integers times ``1 / max``, floats as float32), shapes blend into
it (``(1 - a) * dest + a * colour``), and ``show(path)`` writes each channel as
``(uint8)(255 * clamp(v, 0, 1))``, rows from the top. The expected bytes below are computed
with NumPy from those rules (in float32, as the canvas computes); the same tests pass on
Taichi 1.7.4 (``DIFFTAPE_TEST_PEER=taichi``), which shows that the rules are Taichi's.
"""

import os
import struct
import zlib

import numpy as np
import pytest

F32 = np.float32
W, H = 37, 23


def byte(v):
    """The byte a canvas value becomes in a file: (uint8)(255 * clamp(v, 0, 1)) in float32."""
    return (F32(255) * np.clip(np.asarray(v, F32), F32(0), F32(1))).astype(np.uint8)


def channel(c):
    """A colour byte on the canvas: c * (1 / 255.0f), in float32."""
    return F32(c) * (F32(1) / F32(255))


def make_gui(ti, res=(W, H), **kwargs):
    return ti.GUI("test", res=res, show_gui=False, **kwargs)


def shown(ti, gui, tmp_path, name="frame.png"):
    """Write the frame and read it back as uint8 [x, y, c]."""
    path = str(tmp_path / name)
    gui.show(path)
    return ti.tools.imread(path)


def write_png(path, rows):
    """A minimal 8-bit RGB PNG writer (rows: uint8 (h, w, 3), top row first), independent of
    the library under test."""
    h, w, _ = rows.shape
    raw = b"".join(b"\x00" + rows[y].tobytes() for y in range(h))

    def chunk(kind, body):
        return (struct.pack(">I", len(body)) + kind + body
                + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF))

    data = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))
    with open(path, "wb") as f:
        f.write(data)


# -- set_image -------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["u8", "f32", "f64"])
@pytest.mark.parametrize("vector", [False, True])
@pytest.mark.parametrize("offset", [None, (-5, 7)])
def test_set_image_of_a_field_is_written_exactly(ti, tmp_path, kind, vector, offset):
    rng = np.random.default_rng(3)
    dtype = getattr(ti, kind)
    shape = (W, H, 3) if vector else (W, H)
    if kind == "u8":
        pixels = rng.integers(0, 256, shape).astype(np.uint8)
        expected = pixels
    else:
        pixels = rng.random(shape).astype(np.float32 if kind == "f32" else np.float64)
        pixels[0, 0] = 1.5  # clipped
        expected = byte(pixels.astype(F32))
    if vector:
        img = ti.Vector.field(3, dtype, shape=(W, H), offset=offset)
    else:
        img = ti.field(dtype, shape=(W, H), offset=offset)
    img.from_numpy(pixels)
    gui = make_gui(ti)
    gui.set_image(img)
    got = shown(ti, gui, tmp_path)
    if not vector:
        expected = np.repeat(expected[:, :, None], 3, axis=2)
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32, np.float32, np.float64])
@pytest.mark.parametrize("channels", [1, 2, 3, 4])
def test_set_image_of_a_numpy_array(ti, tmp_path, dtype, channels):
    rng = np.random.default_rng(channels)
    shape = (W, H) if channels == 1 else (W, H, channels)
    if np.issubdtype(dtype, np.integer):
        top = np.iinfo(dtype).max
        pixels = rng.integers(0, top, shape, dtype=dtype, endpoint=True)
        values = pixels.astype(F32) * F32(1 / top)  # times 1 / max, rounded to float32
    else:
        pixels = rng.random(shape).astype(dtype)
        values = pixels.astype(F32)
    gui = make_gui(ti)
    gui.set_image(pixels)
    got = shown(ti, gui, tmp_path)
    values = values.reshape(W, H, channels)
    rgb = np.zeros((W, H, 3), F32)
    if channels == 1:
        rgb[...] = values
    else:
        rgb[:, :, :min(channels, 3)] = values[:, :, :3]
    np.testing.assert_array_equal(got, byte(rgb))
    assert gui.get_image().shape == (W, H, 4)


def test_set_image_at_the_wrong_resolution_is_refused(ti):
    gui = make_gui(ti)
    with pytest.raises(AssertionError):  # Taichi asserts; difftape's ImageError is one too
        gui.set_image(np.zeros((H, W, 3), np.float32))


@pytest.mark.difftape_only
def test_set_image_refusals_are_image_errors(ti):
    gui = make_gui(ti)
    with pytest.raises(ti.ImageError, match="resolution"):
        gui.set_image(np.zeros((H, W, 3), np.float32))
    with pytest.raises(ti.ImageError, match="int32"):
        gui.set_image(np.zeros((W, H), np.int32))
    with pytest.raises(ti.ImageError, match="set_image takes"):
        gui.set_image([[0.0]])


def test_get_image_is_the_canvas(ti):
    gui = make_gui(ti, background_color=0x804020)
    img = gui.get_image()
    assert img.shape == (W, H, 4) and img.dtype == np.float32
    np.testing.assert_array_equal(img[3, 4], [channel(0x80), channel(0x40), channel(0x20),
                                              channel(255)])


@pytest.mark.parametrize("dtype", ["u8", "f32"])
def test_fast_gui_packs_rgb_rows_from_the_top(ti, dtype):
    rng = np.random.default_rng(5)
    if dtype == "u8":
        pixels = rng.integers(0, 256, (W, H, 3)).astype(np.uint8)
        rgb = pixels.astype(np.int64)
    else:
        pixels = rng.random((W, H, 3)).astype(np.float32)
        rgb = np.clip((pixels * F32(255)).astype(np.int64), 0, 255)
    img = ti.Vector.field(3, getattr(ti, dtype), shape=(W, H))
    img.from_numpy(pixels)
    gui = make_gui(ti, fast_gui=True)
    gui.set_image(img)
    packed = (rgb[:, :, 0] << 16) + (rgb[:, :, 1] << 8) + rgb[:, :, 2]
    np.testing.assert_array_equal(gui.img, packed[:, ::-1].T.reshape(-1))


# -- image files -----------------------------------------------------------------------------

@pytest.mark.parametrize(("comp", "ext"), [(1, "png"), (3, "png"), (4, "png"), (3, "bmp")])
@pytest.mark.parametrize("is_field", [False, True])
def test_imwrite_imread_round_trip(ti, tmp_path, comp, ext, is_field):
    rng = np.random.default_rng(comp)
    shape = (W, H) if comp == 1 else (W, H, comp)
    pixels = rng.integers(0, 256, shape).astype(np.uint8)
    img = pixels
    if is_field:
        img = ti.field(ti.u8, shape=shape)
        img.from_numpy(pixels)
    path = str(tmp_path / f"img.{ext}")
    ti.tools.imwrite(img, path)
    got = ti.tools.imread(path)
    assert got.shape == (W, H, comp) and got.dtype == np.uint8
    np.testing.assert_array_equal(got.reshape(shape), pixels)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.uint16, np.uint32])
def test_imwrite_scales_floats_and_wide_integers(ti, tmp_path, dtype):
    rng = np.random.default_rng(7)
    if np.issubdtype(dtype, np.integer):
        pixels = rng.integers(0, np.iinfo(dtype).max, (W, H, 3), dtype=dtype, endpoint=True)
        expected = (pixels // (np.iinfo(dtype).max // 256)).astype(np.uint8)
    else:
        pixels = (rng.random((W, H, 3)) * 1.2 - 0.1).astype(dtype)
        expected = (np.clip(pixels, 0, 1) * 255.0).astype(np.uint8)
    path = str(tmp_path / "img.png")
    ti.tools.imwrite(pixels, path)
    np.testing.assert_array_equal(ti.tools.imread(path), expected)


def test_imread_layout_is_x_right_y_up(ti, tmp_path):
    rows = np.zeros((H, W, 3), np.uint8)  # as stored: top row first
    rows[0, 0] = [255, 0, 0]  # top left
    rows[H - 1, 2] = [0, 255, 0]  # bottom row, third pixel
    path = str(tmp_path / "layout.png")
    write_png(path, rows)
    img = ti.tools.imread(path)
    assert img.shape == (W, H, 3)
    np.testing.assert_array_equal(img[0, H - 1], [255, 0, 0])
    np.testing.assert_array_equal(img[2, 0], [0, 255, 0])
    np.testing.assert_array_equal(img, rows.swapaxes(0, 1)[:, ::-1])


@pytest.mark.difftape_only  # Taichi 1.7.4 reads the converted pixels with the file's channel
def test_imread_converts_channels_as_stb_image(ti, tmp_path):  # count: garbage
    rng = np.random.default_rng(11)
    rows = rng.integers(0, 256, (H, W, 3)).astype(np.uint8)
    path = str(tmp_path / "rgb.png")
    write_png(path, rows)
    r, g, b = (rows[..., k].astype(np.uint32) for k in range(3))
    luma = ((77 * r + 150 * g + 29 * b) >> 8).astype(np.uint8)  # stb_image's grey
    grey = ti.tools.imread(path, 1)
    np.testing.assert_array_equal(grey[:, :, 0], luma.T[:, ::-1])
    rgba = ti.tools.imread(path, 4)
    np.testing.assert_array_equal(rgba[:, :, 3], 255)
    np.testing.assert_array_equal(rgba[:, :, :3], rows.swapaxes(0, 1)[:, ::-1])


@pytest.mark.parametrize("scale", [1, 2, 3])
def test_imresize_takes_the_nearest_pixel_below(ti, scale):
    rng = np.random.default_rng(scale)
    img = rng.random((W, H, 3)).astype(np.float32)
    out = ti.tools.imresize(img, W * scale, H * scale)
    assert out.shape == (W * scale, H * scale, 3)
    np.testing.assert_array_equal(out, np.repeat(np.repeat(img, scale, 0), scale, 1))
    half = ti.tools.imresize(img, W // 2, H // 2)
    xs = (np.arange(W // 2) * (W / (W // 2))).astype(int)
    ys = (np.arange(H // 2) * (H / (H // 2))).astype(int)
    np.testing.assert_array_equal(half, img[xs][:, ys])


# -- shapes ----------------------------------------------------------------------------------

def test_circle_covers_pixels_by_distance_from_their_corner(ti, tmp_path):
    gui = make_gui(ti)
    cx, cy, r = 0.4, 0.55, 6.3
    gui.circle((cx, cy), 0xFFFFFF, r)
    got = shown(ti, gui, tmp_path)
    centre = (F32(W) * F32(cx), F32(H) * F32(cy))
    i, j = np.meshgrid(np.arange(W), np.arange(H), indexing="ij")
    dx, dy = centre[0] - i.astype(F32), centre[1] - j.astype(F32)
    alpha = np.clip(F32(r) - np.sqrt(dx * dx + dy * dy), F32(0), F32(1)) * channel(255)
    # white over black: (1 - a) * 0 + a * 1
    expected = byte(alpha * channel(255))
    np.testing.assert_array_equal(got[:, :, 0], expected)
    assert got[int(centre[0]), int(centre[1])].tolist() == [255, 255, 255]


def test_line_covers_pixel_centres_by_distance_from_the_segment(ti, tmp_path):
    gui = make_gui(ti, background_color=0x000000)
    a, b, r = (0.1, 0.2), (0.8, 0.7), 2.5
    gui.line(a, b, radius=r, color=0xFFFFFF)
    got = shown(ti, gui, tmp_path)
    pa = np.array([W * a[0], H * a[1]])
    pb = np.array([W * b[0], H * b[1]])
    i, j = np.meshgrid(np.arange(W) + 0.5, np.arange(H) + 0.5, indexing="ij")
    p = np.stack([i, j], -1)
    d = pb - pa
    t = np.clip(((p - pa) @ d) / (d @ d), 0, 1)
    dist = np.linalg.norm(p - (pa + t[..., None] * d), axis=-1)
    alpha = np.clip(r - dist, 0, 1)
    # float32 against float64 distances: exact away from the anti-aliased rim
    solid, empty = alpha == 1, alpha == 0
    assert solid.sum() > 50
    assert (got[solid] == 255).all() and (got[empty] == 0).all()
    rim = ~solid & ~empty
    assert np.abs(got[rim][:, 0].astype(int) - (alpha[rim] * 255)).max() <= 1


def test_triangles_fill_the_pixels_whose_centre_is_inside(ti, tmp_path):
    gui = make_gui(ti, background_color=0x102030)
    a = np.array([[0.1, 0.1], [0.6, 0.9]])
    b = np.array([[0.9, 0.2], [0.9, 0.9]])
    c = np.array([[0.3, 0.8], [0.6, 0.5]])
    gui.triangles(a, b, c, color=np.array([0xFF0000, 0x00FF00]))
    got = shown(ti, gui, tmp_path)
    i, j = np.meshgrid(np.arange(W) + 0.5, np.arange(H) + 0.5, indexing="ij")

    def inside(p, q, r):
        p, q, r = (np.array([W * v[0], H * v[1]]) for v in (p, q, r))
        s = [(i - u[0]) * (v[1] - u[1]) - (j - u[1]) * (v[0] - u[0])
             for u, v in ((p, q), (q, r), (r, p))]
        return ((s[0] <= 0) & (s[1] <= 0) & (s[2] <= 0)) | ((s[0] >= 0) & (s[1] >= 0)
                                                            & (s[2] >= 0))

    first, second = inside(a[0], b[0], c[0]), inside(a[1], b[1], c[1])
    expected = np.empty((W, H, 3), np.uint8)
    expected[...] = [0x10, 0x20, 0x30]
    expected[first] = [255, 0, 0]
    expected[second] = [0, 255, 0]  # drawn last: on top
    np.testing.assert_array_equal(got, expected)


def test_circles_blend_in_draw_order(ti, tmp_path):
    # Two half-transparent rims over one pixel: the later circle's colour weighs more.
    gui = make_gui(ti, res=(8, 8))
    pos = np.array([[0.5, 0.5], [0.5, 0.5]])
    gui.circles(pos, radius=np.array([3.4, 3.6]), color=np.array([0xFF0000, 0x0000FF]))
    got = shown(ti, gui, tmp_path)
    # pixel (1, 4): distance 3 from the centre (4, 4): alphas 0.4 and 0.6
    a1 = np.clip(F32(3.4) - F32(3), F32(0), F32(1)) * channel(255)
    a2 = np.clip(F32(3.6) - F32(3), F32(0), F32(1)) * channel(255)
    red = (F32(1) - a2) * ((F32(1) - a1) * F32(0) + a1 * channel(255)) + a2 * F32(0)
    blue = (F32(1) - a2) * ((F32(1) - a1) * F32(0) + a1 * F32(0)) + a2 * channel(255)
    assert got[1, 4].tolist() == [byte(red), 0, byte(blue)]


def test_rect_draws_four_lines(ti, tmp_path):
    gui = make_gui(ti, res=(40, 40))
    gui.rect((0.25, 0.75), (0.75, 0.25), radius=1.5, color=0xFFFFFF)
    got = shown(ti, gui, tmp_path)[:, :, 0]
    assert got[20, 30] == 255 and got[20, 10] == 255  # top and bottom sides
    assert got[10, 20] == 255 and got[30, 20] == 255  # left and right sides
    assert got[20, 20] == 0 and got[2, 2] == 0


def test_show_clears_the_canvas_to_the_background(ti, tmp_path):
    gui = make_gui(ti, background_color=0x336699)
    gui.circles(np.random.default_rng(0).random((30, 2)), radius=3, color=0xFFFFFF)
    shown(ti, gui, tmp_path, "first.png")
    second = shown(ti, gui, tmp_path, "second.png")
    assert gui.frame == 2
    assert (second == [0x33, 0x66, 0x99]).all()


# -- a program that draws its frames ---------------------------------------------------------

def test_a_simulation_writes_its_frames(ti, tmp_path):
    n, steps, dt = 16, 6, 0.02
    x = ti.Vector.field(2, ti.f32, shape=n)
    v = ti.Vector.field(2, ti.f32, shape=n)

    @ti.kernel
    def init():
        for i in x:
            x[i] = [0.1 + 0.05 * i, 0.9]
            v[i] = [0.0, 0.0]

    @ti.kernel
    def step():
        for i in x:
            v[i].y -= 9.8 * dt
            x[i] += dt * v[i]

    init()
    gui = ti.GUI("falling", res=(64, 64), background_color=0xFFFFFF, show_gui=False)
    assert gui.running and not gui.get_event(ti.GUI.PRESS) and list(gui.get_events()) == []
    for t in range(steps):
        step()
        pos = x.to_numpy()
        gui.circles(pos, radius=3, color=0x0000FF)
        gui.line((0, 0.1), (1, 0.1), radius=2, color=0x000000)
        gui.show(str(tmp_path / f"{t:03d}.png"))
        frame = ti.tools.imread(str(tmp_path / f"{t:03d}.png"))
        px = (pos * 64).astype(int)
        for i in range(n):  # a blue pixel under each particle's centre
            assert frame[px[i, 0], px[i, 1]].tolist() == [0, 0, 255], (t, i)
        assert (frame[:, 6] == 0).all()  # the ground line
    assert sorted(os.listdir(tmp_path)) == [f"{t:03d}.png" for t in range(steps)]


# -- no display ------------------------------------------------------------------------------

def test_show_gui_without_a_display_is_refused_as_taichi_does(ti, monkeypatch):
    monkeypatch.delenv("DISPLAY", raising=False)
    monkeypatch.delenv("WAYLAND_DISPLAY", raising=False)
    monkeypatch.delenv("TI_GUI_SHOW", raising=False)
    with pytest.raises(RuntimeError, match="show_gui=False"):
        ti.GUI("window", res=(16, 16))


def test_ti_gui_show_0_draws_headless(ti, monkeypatch, tmp_path):
    monkeypatch.delenv("DISPLAY", raising=False)
    monkeypatch.setenv("TI_GUI_SHOW", "0")
    gui = ti.GUI("window", res=(16, 16), background_color=0x00FF00)  # show_gui=True by default
    assert (shown(ti, gui, tmp_path) == [0, 255, 0]).all()


@pytest.mark.difftape_only
def test_refusals_are_difftape_errors(ti, monkeypatch, tmp_path):
    monkeypatch.delenv("DISPLAY", raising=False)
    monkeypatch.delenv("TI_GUI_SHOW", raising=False)
    with pytest.raises(ti.MediaError, match="cannot open a window"):
        ti.GUI("window")
    gui = make_gui(ti)
    with pytest.raises(ti.ImageError, match="unknown suffix"):
        gui.show(str(tmp_path / "frame.tiff"))
    with pytest.raises(ti.MediaError, match="cannot write"):
        gui.show(str(tmp_path / "no" / "such" / "dir.png"))
    with pytest.raises(ti.MediaError, match="cannot read"):
        ti.tools.imread(str(tmp_path / "missing.png"))
    with pytest.raises(ti.MediaError, match="imwrite"):
        ti.tools.imshow(np.zeros((4, 4), np.uint8))
    with pytest.raises(ti.ImageError, match="fast_gui"):
        make_gui(ti, fast_gui=True).circle((0.5, 0.5))


# -- GGUI (ti.ui.Window, Scene, ...) ---------------------------------------------------------

def test_ti_ui_has_the_ggui_names(ti):
    """ti.ui has GGUI's names (whether or not they can work here)."""
    for name in ("Window", "Scene", "Canvas", "Camera", "make_camera", "ProjectionMode"):
        assert hasattr(ti.ui, name), name


@pytest.mark.difftape_only
def test_ggui_is_refused_saying_there_is_none(ti):
    """difftape has no GGUI renderer: creating a window, scene or camera raises a MediaError
    that says so and names what to draw with instead, rather than an object drawing nothing
    (or, for ti.ui.Scene(), only Taichi's deprecation warning)."""
    assert ti.ui.GGUI_AVAILABLE is False and ti.ui.ProjectionMode is None
    for make in (lambda: ti.ui.Window("w", (64, 64)), ti.ui.Scene, ti.ui.Camera,
                 ti.ui.make_camera):
        with pytest.raises(ti.MediaError, match=r"difftape has no GGUI .*ti\.GUI") as info:
            make()
        assert isinstance(info.value, RuntimeError)


# -- video -----------------------------------------------------------------------------------

@pytest.mark.difftape_only
def test_video_manager_writes_frames_and_a_gif(ti, tmp_path):
    from PIL import Image

    video = ti.tools.VideoManager(str(tmp_path), framerate=10, automatic_build=False)
    for k in range(5):
        img = np.zeros((W, H, 3), np.uint8)  # odd sizes: the last row and column dropped
        img[k * 4:k * 4 + 4, :] = [255, 128, 0]
        with pytest.warns(UserWarning, match="odd"):
            video.write_frame(img)
    assert sorted(os.listdir(video.get_frame_directory())) == [f"{k:06d}.png"
                                                                for k in range(5)]
    video.make_video(mp4=False, gif=True)
    with Image.open(tmp_path / "video.gif") as gif:
        assert gif.n_frames == 5 and gif.size == (W - 1, H - 1)
        for k in range(5):
            gif.seek(k)
            rows = np.asarray(gif.convert("RGB"))
            expected = np.zeros((W - 1, H - 1, 3), np.uint8)
            expected[k * 4:k * 4 + 4, :] = [255, 128, 0]
            # GIF palettes are exact for a two-colour frame
            np.testing.assert_array_equal(rows, expected.swapaxes(0, 1)[::-1])


@pytest.mark.difftape_only
def test_video_manager_refuses_mp4_without_ffmpeg(ti, tmp_path, monkeypatch):
    from difftape.ui import video as video_mod

    monkeypatch.setattr(video_mod, "ffmpeg_path", lambda: None)
    video = ti.tools.VideoManager(str(tmp_path), automatic_build=True)
    with pytest.warns(UserWarning, match="GIF only"):
        for _ in range(4):  # the automatic build after 4 frames makes the GIF alone
            video.write_frame(np.zeros((8, 8, 3), np.uint8))
    assert (tmp_path / "video.gif").exists() and not (tmp_path / "video.mp4").exists()
    with pytest.raises(ti.MediaError, match="needs ffmpeg"):
        video.make_video(mp4=True, gif=False)
