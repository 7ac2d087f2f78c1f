"""A generated corpus of hostile and unusual image uploads (nothing is downloaded).

``hostile_corpus(max_pixels)`` returns one :class:`Upload` per kind: broken files, files that pose as images,
polyglots, decompression bombs that declare huge dimensions, extreme shapes, unusual modes and containers, bad
metadata, and valid images just under the pixel limit.  Each says what a correct service must answer:

* ``"ok"``: a readable image — 200 with a caption;
* ``"reject"``: not an image we can caption — a 4xx problem document (never a 5xx);
* ``"either"``: decoders legitimately differ (e.g. a JPEG truncated after its first scan still decodes with
  grey fill in some libjpeg builds) — 200 or a 4xx problem, never a 5xx.

Used by ``tests/test_hostile_images.py`` (default suite) and, loaded by file path, by
``benchmarks/reliability.py`` (which must not import the ``tests`` package).
"""

from __future__ import annotations

import io
import struct
import zlib
from dataclasses import dataclass

import numpy as np
from PIL import Image, TiffImagePlugin

Expect = str  # "ok" | "reject" | "either"


@dataclass(frozen=True)
class Upload:
    kind: str
    data: bytes
    filename: str = "upload.bin"
    content_type: str = "application/octet-stream"
    expect: Expect = "either"


def _save(image: Image.Image, fmt: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **options)
    return buffer.getvalue()


def _scene(width: int = 96, height: int = 72, seed: int = 0) -> Image.Image:
    """A small picture with structure (gradients and noise), so codecs produce non-trivial streams."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([x * 255 // max(width - 1, 1), y * 255 // max(height - 1, 1), (x + y) % 256], axis=-1)
    rgb = (rgb + rng.integers(0, 40, rgb.shape)).clip(0, 255).astype(np.uint8)
    return Image.fromarray(rgb, "RGB")


def _png_chunk(kind: bytes, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))


def _raw_png(width: int, height: int, bit_depth: int, color_type: int, raw_rows: bytes,
             extra: list[tuple[bytes, bytes]] = ()) -> bytes:
    """A PNG written by hand, so headers can say what PIL would never write (16-bit RGB, lying sizes)."""
    ihdr = struct.pack(">IIBBBBB", width, height, bit_depth, color_type, 0, 0, 0)
    chunks = [_png_chunk(b"IHDR", ihdr), *(_png_chunk(k, v) for k, v in extra),
              _png_chunk(b"IDAT", zlib.compress(raw_rows, 9)), _png_chunk(b"IEND", b"")]
    return b"\x89PNG\r\n\x1a\n" + b"".join(chunks)


def _png_declaring(width: int, height: int) -> bytes:
    """A decompression bomb: a valid PNG header declaring ``width``×``height`` RGB pixels over one tiny row."""
    return _raw_png(width, height, 8, 2, b"\x00" + b"\x00" * 3 * min(width, 64))


def _zero_png_bomb(side: int) -> bytes:
    """A real bomb: ``side``² black pixels that deflate to a few kilobytes."""
    rows = (b"\x00" + b"\x00" * side) * side
    return _raw_png(side, side, 8, 0, rows)


def _gif_declaring(width: int, height: int) -> bytes:
    """A GIF whose logical screen and only frame claim ``width``×``height`` (at most 65535 each)."""
    header = b"GIF89a" + struct.pack("<HHBBB", width, height, 0x80, 0, 0) + b"\x00\x00\x00\xff\xff\xff"
    frame = b"\x2c" + struct.pack("<HHHHB", 0, 0, width, height, 0) + b"\x02\x02\x44\x01\x00"
    return header + frame + b"\x3b"


def _webp_declaring(width: int, height: int) -> bytes:
    """A lossy WebP container whose VP8 frame header declares ``width``×``height`` (at most 16383)."""
    frame = b"\x9d\x01\x2a" + struct.pack("<HH", width & 0x3FFF, height & 0x3FFF)
    vp8 = b"\x50\x12\x00" + frame + b"\x00" * 16  # a key frame tag, then the start code and sizes
    chunk = b"VP8 " + struct.pack("<I", len(vp8)) + vp8
    return b"RIFF" + struct.pack("<I", 4 + len(chunk)) + b"WEBP" + chunk


def _tiff_declaring(width: int, height: int) -> bytes:
    """A little-endian TIFF whose IFD declares ``width``×``height`` 8-bit grey pixels in one 8-byte strip."""
    entries = [(256, 4, 1, width), (257, 4, 1, height), (258, 3, 1, 8), (259, 3, 1, 1), (262, 3, 1, 1),
               (273, 4, 1, 8 + 2 + 12 * 9 + 4), (277, 3, 1, 1), (278, 4, 1, height), (279, 4, 1, 8)]
    ifd = struct.pack("<H", len(entries)) + b"".join(struct.pack("<HHII", *e) for e in entries) + b"\x00" * 4
    return b"II*\x00" + struct.pack("<I", 8) + ifd + b"\x00" * 8


def _jpeg_declaring(width: int, height: int) -> bytes:
    """A baseline JPEG with its SOF0 dimensions rewritten to ``width``×``height`` (the scan stays tiny)."""
    data = bytearray(_save(_scene(16, 16), "JPEG"))
    at = data.index(b"\xff\xc0")
    data[at + 5:at + 9] = struct.pack(">HH", height, width)
    return bytes(data)


def _replace_adobe_transform(jpeg: bytes, transform: int) -> bytes:
    """Set the colour transform byte of the APP14 "Adobe" segment (0 = CMYK, 2 = YCCK)."""
    data = bytearray(jpeg)
    at = data.find(b"\xff\xeeA\x00dobe")  # APP14 marker, 2-byte length, then "Adobe"
    if at < 0:
        at = data.find(b"Adobe") - 4
        if at < 0:
            raise ValueError("no Adobe segment to patch")
    data[at + 4 + 11] = transform  # "Adobe"(5) version(2) flags0(2) flags1(2) → transform
    return bytes(data)


def _exif_with_orientation(value: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = value
    return exif.tobytes()


def _exif_huge() -> bytes:
    """An EXIF block as big as a JPEG APP1 segment allows (~64 KiB): a huge ImageDescription and MakerNote."""
    exif = Image.Exif()
    exif[0x010E] = "A" * 30000  # ImageDescription
    exif[0x0112] = 6
    exif[0x927C] = b"\x00" * 30000  # MakerNote
    return exif.tobytes()


def _multipage_tiff() -> bytes:
    frames = [_scene(64, 48, seed) for seed in range(3)]
    return _save(frames[0], "TIFF", save_all=True, append_images=frames[1:])


def _animated(fmt: str) -> bytes:
    frames = [_scene(64, 48, seed) for seed in range(4)]
    return _save(frames[0], fmt, save_all=True, append_images=frames[1:], duration=80, loop=0)


def _cmyk_jpeg() -> bytes:
    return _save(_scene().convert("CMYK"), "JPEG", quality=90)


def _huge_exif_png() -> bytes:
    """A PNG with a 4 MiB eXIf chunk (PNG sets no limit on chunk sizes below 2³¹)."""
    return _raw_png(8, 8, 8, 2, (b"\x00" + b"\x80" * 24) * 8, extra=[(b"eXIf", b"MM\x00*" + b"\x00" * (4 << 20))])


def _just_under(max_pixels: int, fmt: str) -> bytes:
    """A valid image with ``max_pixels - 1`` pixels or fewer (a flat colour, so the upload stays small)."""
    width = int(max_pixels ** 0.5)
    height = max(1, (max_pixels - 1) // width)
    return _save(Image.new("RGB", (width, height), (90, 140, 200)), fmt)


def _bad_crc_png() -> bytes:
    data = bytearray(_save(_scene(), "PNG"))
    at = data.index(b"IDAT")
    length = struct.unpack(">I", data[at - 4:at])[0]
    data[at + 4 + length] ^= 0xFF  # the first CRC byte of IDAT
    return bytes(data)


def _corrupt_jpeg_huffman() -> bytes:
    data = bytearray(_save(_scene(), "JPEG"))
    at = data.index(b"\xff\xc4")  # DHT: scribble over the code counts
    data[at + 5:at + 21] = b"\xff" * 16
    return bytes(data)


def hostile_corpus(max_pixels: int = 40_000_000) -> list[Upload]:
    """Every kind once; ``max_pixels`` is the service's pixel limit (the "just under" images track it)."""
    scene = _scene()
    jpeg, png, webp, gif = (_save(scene, f) for f in ("JPEG", "PNG", "WEBP", "GIF"))
    tiff, bmp = _save(scene, "TIFF"), _save(scene, "BMP")
    html = b"<!doctype html><html><body><script>alert(1)</script></body></html>"
    svg = (b'<?xml version="1.0"?><svg xmlns="http://www.w3.org/2000/svg" width="100" height="100">'
           b'<rect width="100" height="100" fill="red"/><script>alert(1)</script></svg>')
    pdf = b"%PDF-1.4\n1 0 obj<</Type/Catalog/Pages 2 0 R>>endobj\n2 0 obj<</Type/Pages/Kids[]/Count 0>>endobj\n" \
          b"trailer<</Root 1 0 R>>\n%%EOF\n"
    zip_tail = b"PK\x05\x06" + b"\x00" * 18  # an empty zip's end-of-central-directory record
    palette = scene.convert("P", palette=Image.ADAPTIVE, colors=16)
    la = scene.convert("LA")
    rgb16 = np.random.default_rng(1).integers(0, 65536, (32, 40, 3), dtype=np.uint16).astype(">u2")
    rows16 = b"".join(b"\x00" + row.tobytes() for row in rgb16)
    grey16 = Image.fromarray(np.random.default_rng(2).integers(0, 65535, (40, 48), dtype=np.uint16))
    floats = Image.fromarray(np.random.default_rng(3).normal(0, 1e6, (40, 48)).astype(np.float32), "F")
    side = int(max_pixels ** 0.5) + 1  # the zero bomb is just above the limit, whatever the limit is

    def jpg(kind: str, data: bytes, expect: Expect) -> Upload:
        return Upload(kind, data, "photo.jpg", "image/jpeg", expect)

    def named(kind: str, data: bytes, filename: str, content_type: str, expect: Expect) -> Upload:
        return Upload(kind, data, filename, content_type, expect)

    return [
        # -- empty, truncated and corrupt files ------------------------------------------------------------
        jpg("zero-bytes", b"", "reject"),
        jpg("one-byte", b"\xff", "reject"),
        jpg("jpeg-magic-only", b"\xff\xd8\xff", "reject"),
        named("png-magic-only", png[:8], "x.png", "image/png", "reject"),
        jpg("truncated-jpeg-header", jpeg[:40], "reject"),
        jpg("truncated-jpeg-half", jpeg[: len(jpeg) // 2], "either"),
        named("truncated-png-half", png[: len(png) // 2], "x.png", "image/png", "reject"),
        named("truncated-webp-half", webp[: len(webp) // 2], "x.webp", "image/webp", "either"),
        named("truncated-gif-half", gif[: len(gif) // 2], "x.gif", "image/gif", "either"),
        named("truncated-tiff-half", tiff[: len(tiff) // 2], "x.tiff", "image/tiff", "either"),
        named("truncated-bmp-half", bmp[: len(bmp) // 2], "x.bmp", "image/bmp", "reject"),
        named("png-bad-crc", _bad_crc_png(), "x.png", "image/png", "either"),
        jpg("jpeg-corrupt-huffman", _corrupt_jpeg_huffman(), "either"),
        jpg("random-bytes", np.random.default_rng(4).integers(0, 256, 4096, dtype=np.uint8).tobytes(), "reject"),
        # -- other things posing as images -----------------------------------------------------------------
        jpg("text-as-jpeg", b"just some text, not an image\n" * 10, "reject"),
        jpg("html-as-jpeg", html, "reject"),
        named("svg-as-image", svg, "x.svg", "image/svg+xml", "reject"),
        named("svg-as-png", svg, "x.png", "image/png", "reject"),
        jpg("pdf-as-jpeg", pdf, "reject"),
        jpg("json-as-jpeg", b'{"image": "not really"}', "reject"),
        # -- wrong names and content types of real images ----------------------------------------------------
        named("png-named-jpeg", png, "photo.jpg", "image/jpeg", "ok"),
        named("jpeg-as-text-plain", jpeg, "notes.txt", "text/plain", "ok"),
        named("jpeg-as-pdf", jpeg, "doc.pdf", "application/pdf", "ok"),
        named("webp-no-extension", webp, "upload", "application/octet-stream", "ok"),
        named("gif-traversal-filename", gif, "../../../../etc/passwd.gif", "image/gif", "ok"),
        named("bmp", bmp, "x.bmp", "image/bmp", "ok"),
        # -- polyglots -------------------------------------------------------------------------------------
        jpg("jpeg-plus-html", jpeg + html, "ok"),
        named("gif-plus-zip", gif + zip_tail, "x.gif", "image/gif", "ok"),
        named("png-with-script-text-chunk", _raw_png(8, 8, 8, 2, (b"\x00" + b"\x40" * 24) * 8,
                                                     extra=[(b"tEXt", b"Comment\x00" + html)]),
              "x.png", "image/png", "ok"),
        jpg("html-then-jpeg", html + jpeg, "reject"),
        # -- decompression bombs (declared dimensions) and real ones ------------------------------------------
        named("png-declares-100000x100000", _png_declaring(100_000, 100_000), "x.png", "image/png", "reject"),
        named("gif-declares-65535x65535", _gif_declaring(65535, 65535), "x.gif", "image/gif", "reject"),
        named("webp-declares-16383x16383", _webp_declaring(16383, 16383), "x.webp", "image/webp", "reject"),
        named("tiff-declares-100000x100000", _tiff_declaring(100_000, 100_000), "x.tiff", "image/tiff", "reject"),
        jpg("jpeg-declares-65500x65500", _jpeg_declaring(65500, 65500), "reject"),
        named("png-zero-bomb-over-limit", _zero_png_bomb(side), "x.png", "image/png", "reject"),
        # -- extreme shapes ----------------------------------------------------------------------------------
        named("1x1", _save(Image.new("RGB", (1, 1), (255, 0, 0)), "PNG"), "x.png", "image/png", "ok"),
        named("1x100000", _save(Image.new("L", (1, 100_000), 128), "PNG"), "x.png", "image/png", "ok"),
        named("100000x1", _save(Image.new("L", (100_000, 1), 128), "PNG"), "x.png", "image/png", "ok"),
        named("just-under-limit-png", _just_under(max_pixels, "PNG"), "x.png", "image/png", "ok"),
        jpg("just-under-limit-jpeg", _just_under(max_pixels, "JPEG"), "ok"),
        # -- modes and colour spaces -----------------------------------------------------------------------
        jpg("cmyk-jpeg", _cmyk_jpeg(), "ok"),
        jpg("ycck-jpeg", _replace_adobe_transform(_cmyk_jpeg(), 2), "ok"),
        jpg("greyscale-jpeg", _save(scene.convert("L"), "JPEG"), "ok"),
        named("rgb-16bit-png", _raw_png(40, 32, 16, 2, rows16), "x.png", "image/png", "ok"),
        named("grey-16bit-png", _save(grey16, "PNG"), "x.png", "image/png", "ok"),
        named("palette-png-transparency", _save(palette, "PNG", transparency=0), "x.png", "image/png", "ok"),
        named("la-png", _save(la, "PNG"), "x.png", "image/png", "ok"),
        named("bilevel-png", _save(scene.convert("1"), "PNG"), "x.png", "image/png", "ok"),
        named("float32-tiff", _save(floats, "TIFF"), "x.tiff", "image/tiff", "ok"),
        named("cmyk-tiff", _save(scene.convert("CMYK"), "TIFF"), "x.tiff", "image/tiff", "ok"),
        # -- containers with several frames ---------------------------------------------------------------
        named("animated-gif", _animated("GIF"), "x.gif", "image/gif", "ok"),
        named("animated-webp", _animated("WEBP"), "x.webp", "image/webp", "ok"),
        named("multipage-tiff", _multipage_tiff(), "x.tiff", "image/tiff", "ok"),
        # -- metadata ----------------------------------------------------------------------------------------
        jpg("exif-orientation-6", _save(scene, "JPEG", exif=_exif_with_orientation(6)), "ok"),
        jpg("exif-orientation-0", _save(scene, "JPEG", exif=_exif_with_orientation(0)), "ok"),
        jpg("exif-orientation-65535", _save(scene, "JPEG", exif=_exif_with_orientation(65535)), "ok"),
        jpg("exif-garbage", _save(scene, "JPEG", exif=b"Exif\x00\x00" + b"\xde\xad\xbe\xef" * 64), "ok"),
        jpg("exif-huge", _save(scene, "JPEG", exif=_exif_huge()), "ok"),
        named("png-4mib-exif-chunk", _huge_exif_png(), "x.png", "image/png", "either"),
        jpg("corrupt-icc-profile", _save(scene, "JPEG", icc_profile=b"\x00garbage ICC" * 100), "ok"),
        named("png-corrupt-icc-profile", _save(scene, "PNG", icc_profile=b"\x01not an icc profile" * 20),
              "x.png", "image/png", "ok"),
        # -- encodings -----------------------------------------------------------------------------------------
        jpg("progressive-jpeg", _save(scene, "JPEG", progressive=True, quality=85), "ok"),
        jpg("jpeg-4-2-0-optimized", _save(scene, "JPEG", optimize=True, subsampling=2), "ok"),
        named("interlaced-gif", _save(scene, "GIF", interlace=True), "x.gif", "image/gif", "ok"),
        named("lossless-webp", _save(scene, "WEBP", lossless=True), "x.webp", "image/webp", "ok"),
    ]


# TiffImagePlugin is imported for its side effect of registering the TIFF writer before any save
assert TiffImagePlugin
