"""The one reader of image files, for every command that opens one (train's image folders, eval,
attention, predict): only the formats an image classifier takes, sizes checked from the header
before anything is decoded, 16-bit images scaled to 8 bits. No torch.

An image file may come from anyone's folder. PIL opens some 40 formats by content, whatever the
name says, and some run programs (an EPS file named ``.png`` makes PIL run Ghostscript from
PATH); a 2 KB PNG can claim a million pixels in a row, which a resize to the model's input turns
into gigabytes. So :func:`open_image` opens only :data:`FORMATS` (``Image.open(formats=...)``),
refuses more than :data:`MAX_PIXELS` pixels or a side more than :data:`MAX_ASPECT` times the
other, and, given the side the image will be resized to (``resize_to``: the shorter side's
target), refuses a resize of more than :data:`MAX_RESIZED_PIXELS` before any pixel is allocated.
Every failure is one :class:`UnreadableImage` line naming the file.
``tests/test_bad_files.py`` fails on an ``Image.open`` anywhere else.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..errors import CmhsaError, first_line
from .paths import open_regular

# the formats of the names torchvision's ImageFolder takes (.jpg .jpeg .png .ppm .pgm .bmp .tif
# .tiff .webp), as PIL names them; nothing else is decoded
FORMATS = ("JPEG", "PNG", "PPM", "BMP", "TIFF", "WEBP")
MAX_IMAGE_BYTES = 256 * 2**20  # one image file
MAX_PIXELS = 89_478_485  # PIL's decompression-bomb warning limit (MAX_IMAGE_PIXELS), held as a limit
MAX_ASPECT = 100  # longer side / shorter side: a panorama is 10 or 20; a 1 x 10^6 strip is not a photo
MAX_RESIZED_PIXELS = 2**26  # the image resized for the model: 192 MiB as RGB bytes, 768 MiB as floats
# 16-bit grey as PIL opens it: I;16* from PNG and TIFF, I from a PGM whose maximum is above 255
SIXTEEN_BIT = ("I;16", "I;16B", "I;16L", "I;16N")


class UnreadableImage(CmhsaError):
    """An image that cannot be decoded. Raised in a loader worker, it reaches the main process
    re-made from the worker's formatted traceback; this keeps only the original one-line message."""

    def __init__(self, message: str, path: str | Path | None = None) -> None:
        if "Original Traceback" in message:  # torch's ExceptionWrapper.reraise
            last = message.strip().splitlines()[-1]
            message, path = last.split(": ", 1)[1] if ": " in last else last, None
        super().__init__(message, path)


def resized_pixels(width: int, height: int, shorter_to: int) -> int:
    """Pixels of a ``width`` x ``height`` image once its shorter side is resized to ``shorter_to``
    (timm's evaluation resize, torchvision's Resize with one size), aspect ratio kept."""
    short, long = min(width, height), max(width, height)
    return shorter_to * math.ceil(shorter_to * long / short)


def check_size(width: int, height: int, path: object, resize_to: int | None = None) -> None:
    """UnreadableImage unless a ``width`` x ``height`` image is one a classifier takes: at most
    MAX_PIXELS, its sides within MAX_ASPECT of each other, and (``resize_to``) resized to at most
    MAX_RESIZED_PIXELS."""
    if width < 1 or height < 1:
        raise UnreadableImage(f"is {width}x{height} pixels: an image has at least one", path)
    if width * height > MAX_PIXELS:
        raise UnreadableImage(
            f"is {width:,}x{height:,} pixels, more than the {MAX_PIXELS:,} cmhsa decodes", path
        )
    if max(width, height) > MAX_ASPECT * min(width, height):
        raise UnreadableImage(
            f"is {width:,}x{height:,} pixels: one side more than {MAX_ASPECT} times the other is not an "
            "image a classifier takes (crop it first)",
            path,
        )
    if resize_to is not None and (n := resized_pixels(width, height, resize_to)) > MAX_RESIZED_PIXELS:
        raise UnreadableImage(
            f"is {width:,}x{height:,} pixels; resized for the model (shorter side {resize_to:,} px) it "
            f"would be {n:,} pixels, more than the {MAX_RESIZED_PIXELS:,} cmhsa allocates",
            path,
        )


@contextlib.contextmanager
def open_image(path: str | Path, resize_to: int | None = None) -> Iterator[Any]:
    """A PIL image of the regular file ``path``, of one of FORMATS, its size checked
    (:func:`check_size`) and decoded lazily within the block; an undecodable, empty, truncated,
    oversized or other-format file is UnreadableImage, whatever part of the block PIL fails in."""
    from PIL import Image, UnidentifiedImageError

    path = Path(path)
    with open_regular(path, MAX_IMAGE_BYTES, "image") as f, warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            with Image.open(f, formats=FORMATS) as im:
                check_size(im.width, im.height, path, resize_to)
                yield im
        except UnidentifiedImageError:
            raise UnreadableImage(
                f"not an image of a format cmhsa reads ({', '.join(FORMATS)}), or empty", path
            ) from None
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
            raise UnreadableImage(f"cannot decode the image ({first_line(e, 150)})", path) from None
        except (OSError, ValueError, SyntaxError, EOFError, MemoryError) as e:  # truncated or corrupt
            raise UnreadableImage(
                f"cannot decode the image ({type(e).__name__}: {first_line(e, 150)})", path
            ) from None


def eight_bit(im: Any, path: object = None) -> Any:
    """``im`` with 16-bit grey scaled to 8 bits (PIL's own conversion clips every value above 255
    to white); a float or 32-bit image is refused: it has no one meaning as pixels."""
    from PIL import Image

    if im.mode in SIXTEEN_BIT or im.mode == "I":
        import numpy as np

        values = np.asarray(im, dtype=np.int64)
        if im.mode == "I" and (values.min() < 0 or values.max() > 65535):
            raise UnreadableImage("holds 32-bit integer pixels, not an image a classifier takes", path)
        return Image.fromarray(((values * 255 + 32767) // 65535).astype(np.uint8), mode="L")
    if im.mode == "F":
        raise UnreadableImage("holds floating-point pixels, not an image a classifier takes", path)
    return im


def read_image(
    path: str | Path, mode: str, resize_to: int | None = None, size: tuple[int, int] | None = None
) -> Any:
    """The image file ``path`` decoded (:func:`open_image`), 16-bit grey scaled (:func:`eight_bit`)
    and converted to ``mode`` ('L' or 'RGB'); ``size`` (width, height): decoded straight to it, a
    JPEG at the smallest of its reduced scales that is at least that (PIL's ``draft``: a phone's
    12-megapixel photo never decoded whole), then resized to it (bicubic)."""
    from PIL import Image

    with open_image(path, resize_to) as im:
        try:
            if size is not None and im.size != size:
                im.draft(mode, size)
            out = eight_bit(im, path).convert(mode)
            if size is not None and out.size != size:
                out = out.resize(size, Image.BICUBIC, reducing_gap=3.0)
            return out
        except (OSError, ValueError, SyntaxError, EOFError, MemoryError) as e:
            raise UnreadableImage(
                f"cannot decode the image ({type(e).__name__}: {first_line(e, 150)})", path
            ) from None
