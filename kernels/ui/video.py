"""``ti.tools.VideoManager``: frames to PNG files, then to a GIF (Pillow) and an MP4 (ffmpeg).

As Taichi's: ``write_frame(img)`` writes ``output_dir/frames/000000.png`` ... (``img`` in
Taichi's layout, an odd last row or column dropped, since video codecs want even sizes) and
``make_video(mp4=True, gif=True)`` builds ``video.mp4`` / ``video.gif`` (or ``video_filename``
with those suffixes) from them. Differences, each for a reason: the GIF is made by Pillow at the
frames' own size (Taichi's goes through ffmpeg and is scaled to 320x640), so GIFs need no
ffmpeg; an MP4 needs an ``ffmpeg`` on the PATH (or the one the ``imageio-ffmpeg`` package
ships) and is refused with :class:`~difftape.MediaError` where there is none, where Taichi's
``os.system`` call fails without a word. With ``automatic_build`` (rebuilding the videos after
4, 8, 16, ... frames, as Taichi does) an MP4 that cannot be made is skipped with a warning, so a
program that wants only the GIF runs where ffmpeg is missing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import warnings

import numpy as np

from ..errors import MediaError
from .image import imwrite

__all__ = ["VideoManager", "ffmpeg_path"]

FRAME_FN_TEMPLATE = "%06d.png"
FRAME_DIR = "frames"


def ffmpeg_path() -> str | None:
    """The ffmpeg executable to make MP4s with: ``ffmpeg`` on the PATH, else the binary of the
    ``imageio-ffmpeg`` package where it is installed, else None."""
    found = shutil.which("ffmpeg")
    if found:
        return found
    try:
        # Function-level: an optional package, looked for only when an MP4 is asked for.
        import imageio_ffmpeg
    except ImportError:
        return None
    try:
        return imageio_ffmpeg.get_ffmpeg_exe()
    except RuntimeError:
        return None


class VideoManager:
    """Taichi's ``VideoManager(output_dir, video_filename=None, width=None, height=None,
    post_processor=None, framerate=24, automatic_build=True)``."""

    def __init__(self, output_dir: str, video_filename: str | None = None,
                 width: int | None = None, height: int | None = None, post_processor=None,
                 framerate: int = 24, automatic_build: bool = True) -> None:
        if (width is None) != (height is None):
            raise ValueError("VideoManager: give both width and height, or neither")
        self.width = width
        self.height = height
        self.directory = str(output_dir)
        self.frame_directory = os.path.join(self.directory, FRAME_DIR)
        os.makedirs(self.frame_directory, exist_ok=True)
        self.video_filename = video_filename
        self.next_video_checkpoint = 4
        self.framerate = framerate
        self.post_processor = post_processor
        self.frame_counter = 0
        self.frame_fns: list[str] = []
        self.automatic_build = automatic_build

    def __repr__(self) -> str:
        return (f"<ti.tools.VideoManager {self.directory!r}: {self.frame_counter} frames at "
                f"{self.framerate} fps>")

    def get_output_filename(self, suffix: str) -> str:
        """``output_dir/video<suffix>``, or ``video_filename`` without its extension."""
        if not self.video_filename:
            return os.path.join(self.directory, "video" + suffix)
        return os.path.join(self.directory, os.path.splitext(self.video_filename)[0] + suffix)

    def get_frame_directory(self) -> str:
        """The directory holding the frame files."""
        return self.frame_directory

    def write_frame(self, img) -> None:
        """Write ``img`` (a field, ndarray or NumPy array, Taichi's layout) as the next frame."""
        if not isinstance(img, np.ndarray):
            img = img.to_numpy()
        if img.shape[0] % 2 != 0:
            warnings.warn("VideoManager: the width is odd; the last column is dropped",
                          stacklevel=2)
            img = img[:-1]
        if img.shape[1] % 2 != 0:
            warnings.warn("VideoManager: the height is odd; the last row is dropped",
                          stacklevel=2)
            img = img[:, :-1]
        if self.post_processor:
            img = self.post_processor.process(img)
        if self.width is None:
            self.width, self.height = img.shape[0], img.shape[1]
        fn = FRAME_FN_TEMPLATE % self.frame_counter
        self.frame_fns.append(fn)
        imwrite(img, os.path.join(self.frame_directory, fn))
        self.frame_counter += 1
        if self.automatic_build and self.frame_counter % self.next_video_checkpoint == 0:
            mp4 = ffmpeg_path() is not None
            if not mp4:
                warnings.warn("VideoManager: no ffmpeg here (install it, or pip install "
                              "imageio-ffmpeg); the automatic build makes the GIF only",
                              stacklevel=2)
            self.make_video(mp4=mp4)
            self.next_video_checkpoint *= 2

    def write_frames(self, images) -> None:
        """Write each image of ``images`` as a frame."""
        for img in images:
            self.write_frame(img)

    def clean_frames(self) -> None:
        """Delete the frame files this manager wrote."""
        for fn in self.frame_fns:
            path = os.path.join(self.frame_directory, fn)
            if os.path.exists(path):
                os.remove(path)

    def _frame_paths(self) -> list[str]:
        return [os.path.join(self.frame_directory, fn) for fn in self.frame_fns]

    def make_video(self, mp4: bool = True, gif: bool = True) -> None:
        """Build ``video.mp4`` (ffmpeg, H.264) and/or ``video.gif`` (Pillow) from the frames."""
        if not self.frame_fns:
            raise MediaError("VideoManager.make_video: no frames were written")
        if mp4:
            self._make_mp4()
        if gif:
            self._make_gif()

    def _make_gif(self) -> None:
        # Function-level: Pillow is loaded by the first picture read or written.
        from PIL import Image

        frames = [Image.open(p).convert("RGB") for p in self._frame_paths()]
        frames[0].save(self.get_output_filename(".gif"), save_all=True,
                       append_images=frames[1:], duration=max(1, round(1000 / self.framerate)),
                       loop=0)

    def _make_mp4(self) -> None:
        ffmpeg = ffmpeg_path()
        if ffmpeg is None:
            raise MediaError("VideoManager: an MP4 needs ffmpeg, and there is none here "
                             "(install ffmpeg, or pip install imageio-ffmpeg); "
                             "make_video(mp4=False) makes the GIF alone")
        command = [ffmpeg, "-loglevel", "error", "-y", "-framerate", str(self.framerate),
                   "-i", os.path.join(self.frame_directory, FRAME_FN_TEMPLATE),
                   "-s:v", f"{self.width}x{self.height}", "-c:v", "libx264", "-profile:v",
                   "high", "-crf", "1", "-pix_fmt", "yuv420p",
                   self.get_output_filename(".mp4")]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise MediaError(f"VideoManager: ffmpeg failed ({done.returncode}): "
                             f"{done.stderr.strip()[-2000:]}")
