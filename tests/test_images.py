"""Reading a photo (models/images.py): every format and mode becomes 8-bit RGB as a browser shows it, the header
alone gives the picture's size, and what cannot be read is refused with an error that names it."""

import re

import numpy as np
import pytest
from PIL import Image
from skimage import data

from captioner.models.images import ImageDecodeError, ImageTooLarge, decode_cost, load_image, open_image, picture_size

from .hostile_images import _png_declaring, _save
from .leaks import nothing_left_open


@pytest.mark.parametrize("fmt,mode", [("JPEG", "RGB"), ("PNG", "RGBA"), ("PNG", "L"), ("PNG", "P"), ("WEBP", "RGB"),
                                      ("GIF", "P"), ("BMP", "RGB"), ("TIFF", "CMYK")])
def test_formats_and_modes_become_rgb(fmt, mode):
    image = Image.new("RGB", (30, 20), (200, 10, 10)).convert(mode)
    loaded = load_image(_save(image, fmt))
    assert loaded.mode == "RGB" and loaded.size == (30, 20)


@pytest.mark.parametrize("fmt,dtype,full_scale", [("PNG", np.uint16, 65535), ("TIFF", np.uint16, 65535),
                                                   ("TIFF", np.int32, 65535), ("TIFF", np.float32, 1.0),
                                                   ("TIFF", np.float32, 255.0), ("TIFF", np.float32, 65535.0)])
def test_deep_greyscale_is_scaled_to_eight_bits_not_clipped(fmt, dtype, full_scale):
    # convert("RGB") alone clips at 255: a 16-bit photo came out nearly white, a [0, 1] float one black
    grey = data.camera()[::8, ::8]
    deep = Image.fromarray((grey.astype(np.float64) * (full_scale / 255.0)).astype(dtype))
    loaded = np.asarray(load_image(_save(deep, fmt)))
    assert loaded.shape == (*grey.shape, 3)
    np.testing.assert_allclose(loaded[..., 0], grey, atol=1)
    assert (loaded[..., 0] == loaded[..., 2]).all()


@pytest.mark.parametrize("fmt,dtype", [("PNG", np.uint16), ("TIFF", np.int32)])
def test_every_sixteen_bit_value_is_rescaled_to_the_nearest_eight_bit_one(fmt, dtype):
    # the PNG specification's sample depth rescaling (12.5): round(v * 255 / 65535), i.e. round(v / 257); e.g.
    # 65406 is 254.498 of 255, so 254, and 32767 is 127.498, so 127 (a full scale off by one rounds both up); a
    # 32-bit integer picture whose brightest pixel fits 16 bits is scaled from 65,535 too (65,536 rounded 51,529,
    # 200.502 of 255, down)
    every = np.arange(65536, dtype=dtype).reshape(256, 256)
    loaded = np.asarray(load_image(_save(Image.fromarray(every), fmt)))[..., 0]
    np.testing.assert_array_equal(loaded, (every.astype(np.int64) * 2 + 257) // 514)
    assert loaded.reshape(-1)[65406] == 254 and loaded.reshape(-1)[32767] == 127


def test_negative_values_of_a_float_picture_are_black_not_wrapped_to_white():
    # a float image below 0 (a filter's output) is clipped at black; an 8-bit cast of -1 would wrap to 255
    floats = np.tile(np.linspace(-0.5, 1.0, 16, dtype=np.float32), (4, 1))
    loaded = np.asarray(load_image(_save(Image.fromarray(floats, "F"), "TIFF")))[..., 0]
    assert (loaded[floats < 0] == 0).all() and loaded[0, -1] == 255
    np.testing.assert_allclose(loaded[floats >= 0], floats[floats >= 0] * 255, atol=0.5)


def test_values_of_a_float_picture_above_its_largest_full_scale_are_white_not_wrapped_to_black():
    # past 2³²−1 a float picture is scaled from 2³²−1 and its brighter pixels clipped at white; a cast of 256 wraps
    floats = np.array([[0.0, 2.0**30, 2.0**33]], np.float32)
    loaded = np.asarray(load_image(_save(Image.fromarray(floats, "F"), "TIFF")))[..., 0]
    assert loaded.tolist() == [[0, 64, 255]]


@pytest.mark.parametrize("dtype", [np.int32, np.float32])
def test_a_deep_picture_holding_eight_bit_values_keeps_each_of_them(dtype):
    # its brightest pixel fits 255, so it is scaled from 255 and each value is its own 8-bit value (a full scale of
    # 256 turned white into 254, which the ±1 of the scaling test above lets through)
    every = np.arange(256, dtype=dtype).reshape(16, 16)
    loaded = np.asarray(load_image(_save(Image.fromarray(every), "TIFF")))[..., 0]
    np.testing.assert_array_equal(loaded, every.astype(np.uint8))


def test_decoded_arrays_grey_rgb_and_rgba_are_images_and_other_shapes_or_types_are_refused():
    # what scikit-image and OpenCV hold: HxW grey, HxWx3 RGB, HxWx4 RGBA (its transparent pixels laid on white)
    rgba = np.zeros((4, 6, 4), np.uint8)
    rgba[:, :3] = (200, 10, 10, 255)
    grey, rgb = np.full((4, 6), 77, np.uint8), np.ascontiguousarray(rgba[..., :3])
    assert np.asarray(load_image(grey)).tolist() == np.full((4, 6, 3), 77).tolist()
    assert np.asarray(load_image(rgb)).tolist() == rgb.tolist()
    assert load_image(rgba).getpixel((0, 0)) == (200, 10, 10) and load_image(rgba).getpixel((5, 3)) == (255,) * 3
    for shape in [(4, 6, 2), (4, 6, 3, 1), (6,)]:
        with pytest.raises(TypeError, match="HxW, HxWx3 or HxWx4 uint8"):
            load_image(np.zeros(shape, np.uint8))
    # another type is refused as clearly (a float grey array passed, a float RGB one got Pillow's "Cannot handle
    # this data type: (1, 1, 3), <f8")
    for array in [np.zeros((4, 6), np.float32), np.zeros((4, 6, 3)), np.zeros((4, 6), np.uint16)]:
        with pytest.raises(TypeError, match="HxW, HxWx3 or HxWx4 uint8"):
            load_image(array)


@pytest.mark.parametrize("mode", ["RGBA", "LA", "P"])
def test_transparent_pixels_are_white_not_the_colours_they_hide(mode):
    # a transparent pixel's hidden colour is black here; convert("RGB") alone would show it (and the model see it)
    image = Image.new("RGBA", (20, 10), (0, 0, 0, 0))
    image.paste((200, 10, 10, 255), (0, 0, 10, 10))
    if mode == "LA":
        image = image.convert("LA")
    elif mode == "P":
        image = image.convert("P", palette=Image.Palette.ADAPTIVE)
        image.info["transparency"] = image.getpixel((15, 5))
    loaded = load_image(_save(image, "PNG", **({"transparency": image.info["transparency"]} if mode == "P" else {})))
    assert loaded.getpixel((15, 5)) == (255, 255, 255)
    opaque = loaded.getpixel((5, 5))
    assert opaque != (255, 255, 255) and (mode == "LA" or opaque[0] > 150)


def test_exif_orientation_is_applied():
    image = Image.new("RGB", (40, 20), (0, 0, 0))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90° clockwise for display
    loaded = load_image(_save(image, "JPEG", exif=exif))
    assert loaded.size == (20, 40)


def test_gif_first_frame():
    frames = [Image.new("RGB", (10, 10), c) for c in [(255, 0, 0), (0, 0, 255)]]
    assert load_image(_save(frames[0], "GIF", save_all=True, append_images=frames[1:])).getpixel((5, 5))[0] > 200


def test_a_picture_left_on_a_later_frame_is_read_from_its_first():
    # a library caller's PIL image (or one open_image opened) that a viewer turned to its second frame
    frames = [Image.new("RGB", (10, 10), c) for c in [(255, 0, 0), (0, 0, 255)]]
    gif = open_image(_save(frames[0], "GIF", save_all=True, append_images=frames[1:]))
    gif.seek(1)
    assert load_image(gif).getpixel((5, 5))[0] > 200


def test_a_cameras_two_view_jpeg_is_read_as_its_first_view():
    views = [Image.new("RGB", (12, 8), colour) for colour in [(255, 0, 0), (0, 0, 255)]]
    assert load_image(_save(views[0], "MPO", save_all=True, append_images=views[1:])).getpixel((5, 5))[0] > 200


@pytest.mark.parametrize("orientation", range(1, 9))
def test_the_size_read_from_a_header_is_the_size_of_the_picture_the_model_sees(tmp_path, orientation):
    # grounding and attention supervision lay the grid on this size; they read the header's own size, so a
    # photo turned a quarter by its EXIF orientation (5-8) had its grid laid across, not along, the features
    exif = Image.Exif()
    exif[0x0112] = orientation
    path = tmp_path / "turned.jpg"
    Image.new("RGB", (40, 30)).save(path, exif=exif.tobytes())
    assert picture_size(path) == load_image(path).size == ((30, 40) if orientation >= 5 else (40, 30))


def test_the_size_read_from_a_header_leaves_no_file_open(tmp_path):
    # grounding and attention supervision read the size of every photo of a data set
    Image.new("RGB", (40, 30)).save(tmp_path / "photo.jpg")
    with nothing_left_open():
        assert picture_size(tmp_path / "photo.jpg") == (40, 30)


@pytest.mark.parametrize("fmt", ["SPIDER", "PPM", "ICO"])
def test_formats_outside_the_documented_list_are_not_an_image(fmt):
    # Pillow reads these, but a valid SPIDER file failed inside Pillow (EOFError) and reached the service as a 500
    with pytest.raises(ImageDecodeError, match="cannot identify a JPEG, PNG, WebP, GIF, BMP or TIFF image"):
        load_image(_save(Image.new("L" if fmt == "SPIDER" else "RGB", (40, 30)), fmt))


def test_a_sixteen_bit_grey_png_with_a_transparent_value_is_laid_on_white():
    # scaling to 8 bits dropped its tRNS value, so its transparent pixels were captioned and drawn black
    grey = np.tile(np.linspace(1000, 60000, 40), (20, 1)).astype(np.uint16)
    grey[:, :20] = 0
    loaded = load_image(_save(Image.fromarray(grey), "PNG", transparency=0))
    assert loaded.getpixel((5, 5)) == (255, 255, 255) and loaded.getpixel((39, 5))[0] > 200
    # every other value stays opaque: its own grey (60000 of 65535 is 233.46 of 255), not the white under it
    assert loaded.getpixel((39, 5)) == (233, 233, 233)
    assert load_image(_save(Image.fromarray(grey), "PNG")).getpixel((5, 5)) == (0, 0, 0)  # opaque: black


def test_only_the_transparent_sixteen_bit_value_itself_is_see_through():
    # tRNS names one 16-bit value: the near-black values that scale to the same 8-bit 0 stay opaque black
    grey = np.array([[0, 100, 128, 60000]], np.uint16)
    loaded = load_image(_save(Image.fromarray(grey), "PNG", transparency=0))
    assert [loaded.getpixel((x, 0)) for x in range(4)] == [(255, 255, 255), (0, 0, 0), (0, 0, 0), (233, 233, 233)]


def test_a_torn_image_file_is_named(tmp_path):
    # among thousands of photos of a data set, "the image data is truncated" did not say which
    torn = tmp_path / "torn.jpg"
    torn.write_bytes(_save(Image.fromarray(data.astronaut()), "JPEG")[:5000])
    with pytest.raises(ImageDecodeError, match=f"the image data of {torn} is truncated or corrupt"):
        load_image(torn)


def test_an_image_file_is_closed_once_read_whole_or_torn(tmp_path):
    # Pillow keeps a GIF's file open for its other frames, and a torn file's after the failed decode: an archive
    # of many thousands of photos held them open until collected
    frames = [Image.new("RGB", (10, 10), c) for c in [(255, 0, 0), (0, 0, 255)]]
    frames[0].save(tmp_path / "two.gif", save_all=True, append_images=frames[1:])
    (tmp_path / "torn.jpg").write_bytes(_save(Image.fromarray(data.astronaut()), "JPEG")[:5000])
    with nothing_left_open():
        assert load_image(tmp_path / "two.gif").size == (10, 10)
        with pytest.raises(ImageDecodeError):
            load_image(tmp_path / "torn.jpg")


def test_a_file_that_is_no_image_is_named_as_the_upload_or_by_its_path(tmp_path):
    # the service opens an upload, and picture_size a data set's photo, without a name: the 422's detail says "the
    # upload", and grounding's error the path
    with pytest.raises(ImageDecodeError, match="image in the upload$"):
        open_image(b"not an image at all")
    notes = tmp_path / "notes.jpg"
    notes.write_bytes(b"not an image at all")
    with pytest.raises(ImageDecodeError, match=f"image in {re.escape(str(notes))}$"):
        picture_size(notes)


def test_bad_images_raise_clear_errors():
    with pytest.raises(ImageDecodeError, match="cannot identify"):
        load_image(b"not an image at all")
    truncated = _save(Image.fromarray(data.astronaut()), "JPEG")[:2000]
    with pytest.raises(ImageDecodeError):
        load_image(truncated)
    with pytest.raises(ImageDecodeError, match="above the limit"):
        load_image(_save(Image.new("RGB", (300, 300)), "PNG"), max_pixels=300 * 299)
    with pytest.raises(ImageTooLarge, match="above the limit"):  # one pixel over is over
        load_image(_save(Image.new("RGB", (300, 300)), "PNG"), max_pixels=300 * 300 - 1)
    assert load_image(_save(Image.new("RGB", (300, 300)), "PNG"), max_pixels=300 * 300).size == (300, 300)
    # a header Pillow itself will not open is refused in terms of one limit, not ours beside Pillow's
    declared_above = 2 * Image.MAX_IMAGE_PIXELS
    for max_pixels, limit in ((40_000_000, 40_000_000), (None, declared_above), (10**12, declared_above)):
        with pytest.raises(ImageTooLarge) as refused:
            load_image(_png_declaring(100_000, 100_000), max_pixels=max_pixels)
        assert str(refused.value) == (f"image is above the limit of {limit} pixels (its header declares more than "
                                      f"{declared_above})")
    # a picture opened already (a library caller's, or open_image's without a limit) is held to it before decoding
    with pytest.raises(ImageTooLarge, match="above the limit"):
        load_image(open_image(_save(Image.new("RGB", (300, 300)), "PNG")), max_pixels=300 * 300 - 1)
    with pytest.raises(ImageDecodeError, match="no such image file: /nonexistent/cat.jpg"):
        load_image("/nonexistent/cat.jpg")


def test_pillows_own_refusal_while_decoding_is_an_image_too_large(monkeypatch):
    """Pillow checks a TIFF's size again when it decodes (``load_prepare``): a picture opened under a looser
    ``MAX_IMAGE_PIXELS`` than the one in force when it is decoded is refused there, and that refusal is ours
    (an :class:`ImageTooLarge`, a 413 for the service), not Pillow's own ``DecompressionBombError``."""
    opened = open_image(_save(Image.new("RGB", (300, 300)), "TIFF"))
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    with pytest.raises(ImageTooLarge, match="above the limit of 2000 pixels"):
        load_image(opened)


def test_a_decodes_cost_counts_the_rows_and_the_depth_a_square_photo_does_not_have():
    """The decode slots counted width × height: a strip one pixel wide (24 bytes a pixel decoded) and a 16-bit
    picture (15) passed for square 8-bit photos (7), and two strips of 39 million pixels took 2 GB (the security
    audit)."""
    def opened(size, mode):
        return open_image(_save(Image.new(mode, size), "PNG"))

    square, strip = opened((300, 300), "RGB"), opened((1, 90_000), "RGB")
    deep = opened((300, 300), "I;16")
    assert decode_cost(square) == 90_000 + 3 * 300
    assert decode_cost(strip) == 4 * 90_000 and decode_cost(deep) == 2 * 90_000 + 3 * 300
    for mode in ("I", "F"):  # 32-bit integer and float pictures are made 8-bit through a copy of themselves too
        assert decode_cost(open_image(_save(Image.new(mode, (300, 300)), "TIFF"))) == 2 * 90_000 + 3 * 300


def test_a_reduced_decode_of_a_jpeg_strip_keeps_its_one_row():
    # an overlay of a panorama strip: its short side, scaled to under half a pixel, asked Pillow for a decode 0
    # pixels high (a ZeroDivisionError, the overlay route's 500)
    strip = _save(Image.new("RGB", (6000, 2), (10, 20, 30)), "JPEG")
    assert load_image(strip, reduce_to=100).size == (3000, 1)


def test_a_picture_above_the_limit_is_refused_naming_its_size_its_pixels_and_the_limit():
    # the 413's detail: an operator compares the picture's pixels with CAPTIONER_MAX_PIXELS
    with pytest.raises(ImageTooLarge) as refused:
        load_image(_save(Image.new("RGB", (300, 200)), "PNG"), max_pixels=59_999)
    assert str(refused.value) == "image is 300x200 = 60000 pixels, above the limit of 59999"


@pytest.mark.parametrize("source", [42, [b"\x89PNG"], None])
def test_a_source_of_another_type_is_refused_by_name(source):
    # without its own refusal, such a source reached the decoding with no image and failed there (UnboundLocalError)
    with pytest.raises(TypeError, match=f"an image must be a path, .* got {type(source).__name__}$"):
        load_image(source)


def test_a_reduced_decode_of_a_colour_jpeg_keeps_its_colours():
    # the overlay's reduced decode (libjpeg's DCT scaling) is asked for the picture's own mode, not a greyscale one
    photo = _save(Image.new("RGB", (800, 600), (200, 30, 40)), "JPEG")
    reduced = load_image(photo, reduce_to=100)
    assert reduced.size == (100, 75)
    red, green, blue = reduced.getpixel((50, 37))
    assert red > 180 and green < 60 and blue < 60


def test_a_big_endian_sixteen_bit_tiff_is_scaled_to_eight_bits_too():
    # Pillow opens a Motorola-order 16-bit TIFF as I;16B, which convert("RGB") would clip at 255 (almost white)
    grey = data.camera()[::8, ::8]
    deep = Image.fromarray((grey.astype(np.uint16) * 257).astype(">u2"))
    assert deep.mode == "I;16B"
    loaded = np.asarray(load_image(_save(deep, "TIFF")))
    np.testing.assert_array_equal(loaded[..., 0], grey)


def test_a_named_image_is_called_by_its_name_in_every_error():
    # captioner caption --output reads each file's bytes and names it: the error list says which file failed, not
    # "the upload"
    with pytest.raises(ImageDecodeError, match="image in IMG_0001.JPG$"):
        load_image(b"not an image at all", name="IMG_0001.JPG")
    torn = _save(Image.fromarray(data.astronaut()), "JPEG")[:5000]
    with pytest.raises(ImageDecodeError, match="^the image data of IMG_0002.JPG is truncated or corrupt"):
        load_image(torn, name="IMG_0002.JPG")


@pytest.mark.parametrize("mode", ["I;16", "I;16L", "I;16B", "I;16N"])
def test_a_sixteen_bit_picture_a_library_caller_made_is_scaled_in_every_byte_order(mode):
    # a caller's picture made from raw 16-bit samples (Image.frombuffer with the native order gives I;16N, which no
    # file opens as): convert("RGB") alone clips it at 255, so a mid-grey 32,896 came out white
    samples = np.array([[0, 257, 32896, 65535]], np.uint16)
    raw = samples.astype(">u2" if mode == "I;16B" else "<u2" if mode in ("I;16", "I;16L") else "=u2").tobytes()
    picture = Image.frombuffer(mode, (4, 1), raw, "raw", mode, 0, 1)
    assert picture.mode == mode
    assert np.asarray(load_image(picture))[0, :, 0].tolist() == [0, 1, 128, 255]


def test_a_reduced_decode_is_the_smallest_that_still_reaches_the_asked_side():
    # the overlay at max_side=300 of an 800x600 photo: a 1/2 decode (400x300), not 1/8 (100x75) drawn up to 300 px
    # and blurred; the smallest of 1, 1/2, 1/4, 1/8 whose longer side is at least the one asked for
    photo = _save(Image.new("RGB", (800, 600), (200, 30, 40)), "JPEG")
    decoded = {side: load_image(photo, reduce_to=side).size for side in (300, 200, 100, 800, 900)}
    assert decoded == {300: (400, 300), 200: (200, 150), 100: (100, 75), 800: (800, 600), 900: (800, 600)}


def test_an_image_file_named_by_a_string_is_closed_once_read_too(tmp_path):
    # a data set's loader and the CLI name photos by str paths as often as by Path objects: a GIF's file, kept open
    # by Pillow for its other frames, was left open for each one read by a str
    frames = [Image.new("RGB", (10, 10), c) for c in [(255, 0, 0), (0, 0, 255)]]
    frames[0].save(tmp_path / "two.gif", save_all=True, append_images=frames[1:])
    with nothing_left_open():
        assert load_image(str(tmp_path / "two.gif")).size == (10, 10)


def test_a_dark_integer_picture_is_not_scaled_as_if_it_were_a_float_one():
    # a float picture may hold [0, 1]; a 32-bit integer one whose brightest pixel is 1 is nearly black (scaled from
    # 255 like any that fits 8 bits), not black and white
    dark = np.array([[0, 1, 1, 0]], np.int32)
    assert np.asarray(load_image(_save(Image.fromarray(dark), "TIFF")))[0, :, 0].tolist() == [0, 1, 1, 0]


def test_a_torn_upload_is_called_the_upload_whether_given_as_bytes_or_opened_first():
    # the service opens an upload (open_image) and decodes it later without a name: the 422's detail must say what
    # was torn, not "the image data of  is truncated" (a BytesIO's picture has an empty filename)
    torn = _save(Image.fromarray(data.astronaut()), "JPEG")[:5000]
    for source in (torn, open_image(torn)):
        with pytest.raises(ImageDecodeError, match="^the image data of the upload is truncated or corrupt"):
            load_image(source)


def test_a_library_callers_own_picture_is_left_open_for_it_to_draw_on():
    # Pipeline takes a decoded picture so that the caller can draw on it afterwards: closing it along with the files
    # load_image opened left the caller's picture failing with "Operation on closed image"
    picture = Image.new("RGB", (30, 20), (200, 10, 10))
    assert load_image(picture).getpixel((5, 5)) == (200, 10, 10)
    assert picture.getpixel((5, 5)) == (200, 10, 10)
