"""Reading a photo: the bytes or file a user gives, decoded into the 8-bit RGB picture every model sees.

One path for training, evaluation and serving (:func:`load_image`): the first frame, the EXIF orientation applied,
a deeper-than-8-bit picture scaled (not clipped), transparency laid on white.  What is refused is refused before
the pixels are decoded where it can be: a format outside :data:`IMAGE_FORMATS`, a picture above ``max_pixels`` (a
decompression bomb, :class:`ImageTooLarge`); :func:`decode_cost` says what decoding will hold, for the service's
decode slots.  The network's input is made from the picture by :func:`~.encoder.preprocess`.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import ExifTags, Image, ImageOps, UnidentifiedImageError


class ImageDecodeError(ValueError):
    """The bytes are not an image we can read."""


class ImageTooLarge(ImageDecodeError):
    """The image declares more pixels than allowed (a decompression bomb): refused before its pixels are decoded."""


#: the formats an image is opened as (the README's list; Pillow's JPEG reader also opens MPO, the JPEG of cameras
#: that store a second view). Pillow would otherwise try every plugin it has, and some (SPIDER, DDS, BLP) fail on
#: odd files with errors no caller can expect, where an unlisted format is one clear "not an image"
IMAGE_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")
#: what Pillow raises on a broken file of those formats (a truncated frame: EOFError; a compression it lacks:
#: NotImplementedError)
_DECODE_ERRORS = (OSError, ValueError, SyntaxError, EOFError, NotImplementedError)
#: the full scale of each integer greyscale mode deeper than 8 bits (Pillow opens 16-bit PNGs and TIFFs as these)
_SIXTEEN_BIT_MODES = ("I;16", "I;16B", "I;16L", "I;16N")


def _eight_bit(image: Image.Image) -> Image.Image:
    """A greyscale image deeper than 8 bits, scaled to 8 bits (with an alpha channel where its transparent grey
    value was, which scaling would otherwise lose: it was laid on black instead of white).

    Pillow's ``convert("RGB")`` clips such values at 255 instead of scaling them, so a 16-bit photo turns almost
    white and a float image in [0, 1] black.  16-bit modes are scaled from 65,535; 32-bit integer (``I``) and
    float (``F``) images carry no nominal depth, so they are scaled from the smallest of 1 (floats only), 255,
    65,535 and 2³²−1 that holds their brightest pixel.
    """
    values = np.asarray(image, dtype=np.float32)
    if image.mode in _SIXTEEN_BIT_MODES:
        full_scale = 65535.0
    else:
        peak = float(values.max()) if values.size else 0.0
        scales = (1.0, 255.0, 65535.0) if image.mode == "F" else (255.0, 65535.0)
        full_scale = next((scale for scale in scales if peak <= scale), 4294967295.0)
    scaled = np.clip(values * (255.0 / full_scale), 0.0, 255.0)
    grey = Image.fromarray(np.rint(scaled).astype(np.uint8), mode="L")
    transparent = image.info.get("transparency")  # a PNG's tRNS: the one grey value that is see-through
    if not isinstance(transparent, int):
        return grey
    alpha = np.where(values == transparent, 0, 255).astype(np.uint8)  # compared before scaling: exact
    return Image.merge("LA", (grey, Image.fromarray(alpha, mode="L")))


def _on_white(image: Image.Image) -> Image.Image:
    """A transparent image (alpha channel or transparent palette entry) laid on white, as a browser shows it on a
    white page: ``convert("RGB")`` alone drops the alpha and reveals whatever colours the hidden pixels hold (often
    black), which the model would caption and the overlay would draw."""
    rgba = image.convert("RGBA")
    return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba)


def _within(image: Image.Image, max_pixels: int | None) -> Image.Image:
    """``image``, refused (:class:`ImageTooLarge`) when its size is above ``max_pixels``."""
    width, height = image.size
    if max_pixels is not None and width * height > max_pixels:
        raise ImageTooLarge(f"image is {width}x{height} = {width * height} pixels, above the limit of {max_pixels}")
    return image


def _declared_too_large(max_pixels: int | None) -> ImageTooLarge:
    """The refusal of a header Pillow would not open (more than twice its ``MAX_IMAGE_PIXELS``), in terms of one
    limit: quoting Pillow's message beside ours named two ("above the limit of 40000000 pixels (… exceeds limit of
    178956970 pixels, could be decompression bomb …)")."""
    declared_above = 2 * Image.MAX_IMAGE_PIXELS
    limit = declared_above if max_pixels is None else min(max_pixels, declared_above)
    return ImageTooLarge(f"image is above the limit of {limit} pixels (its header declares more than "
                         f"{declared_above})")


def open_image(source: bytes | str | Path, max_pixels: int | None = None, name: str | None = None) -> Image.Image:
    """An image file opened with its header read and not a pixel decoded (:func:`load_image` decodes it): its size
    is known, and checked against ``max_pixels``.  Raises what :func:`load_image` raises for a file that is no
    readable image or is too large."""
    try:
        image = Image.open(io.BytesIO(source) if isinstance(source, bytes) else source, formats=IMAGE_FORMATS)
    except FileNotFoundError as exc:  # a path (the CLI), not an upload
        raise ImageDecodeError(f"no such image file: {source}") from exc
    except Image.DecompressionBombError as exc:  # Pillow's own guard fires before ours for gigantic headers
        raise _declared_too_large(max_pixels) from exc
    except (UnidentifiedImageError, *_DECODE_ERRORS) as exc:
        where = name or ("the upload" if isinstance(source, bytes) else str(source))
        raise ImageDecodeError(f"cannot identify a JPEG, PNG, WebP, GIF, BMP or TIFF image in {where}") from exc
    return _within(image, max_pixels)


#: EXIF orientations that turn the picture a quarter turn (transposed, rotated 90° or 270°, transversed)
_QUARTER_TURNS = (5, 6, 7, 8)


def picture_size(source: bytes | str | Path) -> tuple[int, int]:
    """(width, height) of the picture :func:`load_image` makes of an image file, from its header alone: the
    header's size, swapped when the EXIF orientation turns the picture a quarter turn.  What the grid of a photo
    the model saw is laid on (grounding, attention supervision) without decoding it."""
    with open_image(source) as image:
        width, height = image.size
        turned = image.getexif().get(ExifTags.Base.Orientation) in _QUARTER_TURNS
    return (height, width) if turned else (width, height)


#: what decoding holds beyond an 8-bit picture's pixels, in such pixels (about 7 bytes each with the copies made on
#: the way to RGB): Pillow keeps every row apart, so a strip one pixel wide held 24 bytes a pixel (the security
#: audit's 1 x 39,000,000 PNG), and a 16-bit or float picture is made 8-bit through a copy of itself (15 bytes)
ROW_COST, DEEP_FACTOR = 3, 2


def decode_cost(image: Image.Image) -> int:
    """The memory decoding an opened (not yet decoded) ``image`` holds, in pixels of an 8-bit picture: what the
    service's decode slots count (``CAPTIONER_DECODE_PIXELS``), so that a thin or deep picture is not undercounted
    against a square photo of as many pixels."""
    width, height = image.size
    deep = image.mode in (*_SIXTEEN_BIT_MODES, "I", "F")
    return width * height * (DEEP_FACTOR if deep else 1) + ROW_COST * height


def _from_array(pixels: np.ndarray) -> Image.Image:
    """A decoded picture as scikit-image and OpenCV hold one (``HxW`` grey, ``HxWx3`` RGB or ``HxWx4`` RGBA uint8:
    the caller's channel order is taken as RGB) as a PIL image."""
    if pixels.dtype != np.uint8 or not (pixels.ndim == 2 or (pixels.ndim == 3 and pixels.shape[2] in (3, 4))):
        raise TypeError(f"an image array must be HxW, HxWx3 or HxWx4 uint8, got {pixels.dtype} {pixels.shape}")
    return Image.fromarray(pixels)


def load_image(source: bytes | str | Path | Image.Image | np.ndarray, max_pixels: int | None = None,
               reduce_to: int | None = None, name: str | None = None) -> Image.Image:
    """Open an image from bytes or a path: first frame, EXIF orientation applied, transparency laid on white,
    converted to RGB.

    Raises :class:`ImageDecodeError` for anything that is not a readable image, and its subclass
    :class:`ImageTooLarge` for images above ``max_pixels`` (decompression bombs) before their pixels are decoded.
    ``reduce_to``, for pictures that are only shown (overlays), says that the caller shrinks the image to that
    longer side: a JPEG is then decoded at the smallest of 1, 1/2, 1/4 or 1/8 of its size that still reaches it
    (libjpeg's DCT scaling), in a fraction of the memory.  Captioning never passes it: the network's input is made
    from the whole decode, as in training.  ``name`` is what an error calls the image (default: its path, or "the
    upload" for bytes).  ``source`` may be an image :func:`open_image` opened: its header is not read again.
    """
    if isinstance(source, np.ndarray):
        source = _from_array(source)
    if isinstance(source, Image.Image):
        image = _within(source, max_pixels)
    elif isinstance(source, (bytes, str, Path)):
        image = open_image(source, max_pixels, name)
    else:
        raise TypeError("an image must be a path, the file's bytes, a PIL image or an HxW(x3) uint8 array; got "
                        f"{type(source).__name__}")
    # what an error calls it: named, because among thousands of photos of a data set the torn one must be findable
    where = name or getattr(image, "filename", "") or "the upload"
    # a file this call opened, closed when done: Pillow keeps a GIF's or TIFF's file open for its other frames, and
    # a torn file's after the failed decode (an archive of many thousands of photos held them until collected)
    opened = image if isinstance(source, (str, Path)) else None
    width, height = image.size
    try:
        if reduce_to is not None and max(width, height) > reduce_to:
            scale = reduce_to / max(width, height)
            image.draft(image.mode, (max(1, round(width * scale)), max(1, round(height * scale))))
        image.seek(0)  # GIF/TIFF: first frame
        image = ImageOps.exif_transpose(image)
        if image.mode in (*_SIXTEEN_BIT_MODES, "I", "F"):
            image = _eight_bit(image)
        if image.has_transparency_data:
            image = _on_white(image)
        image = image.convert("RGB")
        image.load()
    except Image.DecompressionBombError as exc:
        raise _declared_too_large(max_pixels) from exc
    except _DECODE_ERRORS as exc:
        raise ImageDecodeError(f"the image data of {where} is truncated or corrupt ({exc.__class__.__name__}: "
                               f"{exc})") from exc
    finally:
        if opened is not None:  # never the picture returned: convert() makes a new one, even of an RGB picture
            opened.close()
    return image
