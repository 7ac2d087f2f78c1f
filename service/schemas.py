"""The wire format: every request body and response of the API, as pydantic models that document it in
``/docs`` and serialise the domain objects (:class:`~captioner.models.inference.CaptionResult`,
:class:`~captioner.models.protocol.Geometry`, :class:`~captioner.models.inference.ModelInfo`) in this one place,
rounding included.
"""

from __future__ import annotations

import base64
import dataclasses
from pathlib import PurePath
from typing import TYPE_CHECKING, Annotated, Any, Literal

import orjson
import torch
from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema

from captioner.models.inference import CaptionResult, ModelInfo
from captioner.models.protocol import Geometry

if TYPE_CHECKING:  # the overlay use case's answer, which this module only writes
    from .rendering import Heatmaps

# 6 decimals keep attention rows summing to 1 within 1e-5 while exact zeros (sparsemax, TVmax) stay exactly 0.0
ATTENTION_DECIMALS = 6
LOGPROB_DECIMALS = 5


def _rounded(values: torch.Tensor) -> torch.Tensor:
    return torch.round(values.float(), decimals=ATTENTION_DECIMALS)


def _rows(values: torch.Tensor) -> list:
    return _rounded(values).tolist()


#: how a caption answer writes its attention maps (the client's ``attention_format``): JSON numbers, or the rows of
#: float16 numbers packed in base64 (:class:`PackedRows`: a fifth of the bytes, nothing to parse number by number)
AttentionFormat = Literal["json", "float16-base64"]


def _packed_rows(values: torch.Tensor) -> dict[str, Any]:
    """The rounded map as :class:`PackedRows`: little-endian IEEE float16, row-major."""
    half = _rounded(values).to(torch.float16).numpy().astype("<f2", copy=False)
    return {"encoding": "float16-base64", "shape": list(half.shape),
            "data": base64.b64encode(half.tobytes()).decode("ascii")}


def _map_writer(attention_format: AttentionFormat, json_rows):
    """What writes one attention map for ``attention_format`` (``json_rows``: the writer of JSON numbers)."""
    return _packed_rows if attention_format == "float16-base64" else json_rows


# -- requests -------------------------------------------------------------------------------------------------------
class CaptionOptions(BaseModel):
    """How to caption: the same options as query parameters, multipart form fields or JSON fields."""

    model: str | None = Field(None, description="model name (GET /models); default: the service default")
    beam_size: int | None = Field(None, ge=1, description="beam width")
    max_len: int | None = Field(None, ge=1, description="maximum caption length in tokens")
    length_penalty: float | None = Field(
        None, ge=0.0, le=5.0, allow_inf_nan=False, description="GNMT length penalty α: beams ranked by log-prob / "
        "((5 + length) / 6)^α (0: none; larger: longer captions); default: the model's (GET /models)")
    block_trigrams: bool | None = Field(
        None, description="never repeat a word trigram within a caption; default: the model's (GET /models)")
    block_doubled_words: bool | None = Field(
        None, description="never follow a word with itself (\"green green\"); default: the model's (GET /models)")


CAPTION_OPTIONS = tuple(CaptionOptions.model_fields)


class CaptionJSON(CaptionOptions):
    """JSON alternative to the multipart upload, for clients that cannot send multipart; its options override
    the query parameters.  JSON has types, so they are kept (strict): ``"beam_size": true`` or ``"2"`` is a
    mistake to name, not a beam of 1 or 2 (a number is still a valid ``length_penalty``); and a key it does not
    know is refused by name, as an unknown form part or query parameter is."""

    model_config = ConfigDict(strict=True, extra="forbid")

    image: str = Field(description="the image file, base64-encoded (a data: URL is accepted too)")


class CaptionForm(CaptionOptions):
    """The multipart/form-data body: the image as the ``file`` part, options as form fields (given both here and as
    query parameters, they must agree).  Any other part is refused."""

    file: bytes = Field(json_schema_extra={"format": "binary"},
                        description="image file: JPEG, PNG, WebP, GIF (first frame), BMP or TIFF")


def form_schema() -> dict:
    """:class:`CaptionForm` in OpenAPI: the file as binary, and each option as its one kind (a form field is text
    or absent, never null: a generated client sent its ``None`` as the text "None")."""
    schema = CaptionForm.model_json_schema()
    for name, field in schema["properties"].items():
        kinds = [kind for kind in field.pop("anyOf", []) if kind.get("type") != "null"]
        if kinds:
            field.update(kinds[0])
            field.pop("default", None)
    schema["properties"]["file"] = {"type": "string", "format": "binary",
                                    "description": CaptionForm.model_fields["file"].description}
    schema["additionalProperties"] = False
    return schema


#: the request body of the caption endpoints in OpenAPI (the routes read it themselves, see ``inputs.py``); the form
#: and the JSON body are components (openapi.py puts them there), so that a generated client has one class of each
CAPTION_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {"schema": {"$ref": "#/components/schemas/CaptionForm"}},
            "application/json": {"schema": {"$ref": "#/components/schemas/CaptionJSON"}},
            "image/*": {"schema": {"type": "string", "format": "binary"}},
            "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
        },
    }
}


# -- responses ------------------------------------------------------------------------------------------------------
class Answer(BaseModel):
    """A response body: every field is written, defaults included, so the document marks them all required (a
    generated client typed ``length_penalty`` as possibly absent, ``id`` as possibly undefined)."""

    model_config = ConfigDict(json_schema_serialization_defaults_required=True)


class PackedRows(Answer):
    """An attention map packed for ``attention_format=float16-base64``: decode ``data`` from base64 and read it as
    little-endian IEEE 754 half-precision floats in row-major order of ``shape`` (NumPy:
    ``np.frombuffer(base64.b64decode(data), "<f2").reshape(shape)``).  The values are the JSON answer's numbers
    rounded to float16 (about 3 significant digits; exact zeros stay zero)."""

    encoding: Literal["float16-base64"] = "float16-base64"
    shape: list[int] = Field(description="one row per token, then the map's own dimensions: a column per visual "
                             "item, or (AoANet's heads) a head and a visual item")
    data: str = Field(description="base64 of the little-endian float16 values, row-major")


class GeometryOut(Answer):
    kind: str = Field(description="grid or regions")
    image_size: list[int] = Field(description="(width, height) of the uploaded image after EXIF orientation")
    grid_hw: list[int] | None = Field(description="(rows, cols) of the grid; item i is row-major cell i")
    boxes: list[list[float]] = Field(description="x1, y1, x2, y2 of each visual item in original-image pixels")

    @classmethod
    def of(cls, geometry: Geometry) -> "GeometryOut":
        return cls.model_validate(cls.fields(geometry))

    @staticmethod
    def fields(geometry: Geometry) -> dict[str, Any]:
        """The fields as the model holds them, without validating a thousand box coordinates one by one (the
        boxes are float already)."""
        # Geometry.to_json is the one rounding of boxes (2 decimals), shared with the CLI's JSON output
        return geometry.to_json()


class CaptionOut(Answer):
    # None only in an archive's lines (service/archive.py), which carry no id; every HTTP answer has one
    id: Annotated[str | None, WithJsonSchema({"type": "string"})] = Field(
        None, description="result id, reusable with the overlay endpoints")
    model: str
    checkpoint: str = Field(description="checkpoint folder name (never a server path)")
    beam_size: int
    length_penalty: float = Field(0.0, description="the GNMT length penalty α the caption was decoded with")
    block_trigrams: bool = Field(False, description="whether repeated word trigrams were blocked")
    block_doubled_words: bool = Field(False, description="whether a word was kept from following itself")
    caption: str
    tokens: list[str] = Field(description="emitted words; the last is <eos> when the caption ended normally")
    is_eos: list[bool] = Field(description="flags the <eos> row of the attention")
    token_logprobs: list[float] = Field(description=f"log-probability of each token ({LOGPROB_DECIMALS} decimals)")
    score: float = Field(description="summed log-probability of the caption (the beam score), divided by the "
                                     "length penalty ((5 + length) / 6)^α when length_penalty > 0")
    geometry: GeometryOut
    attention: list[list[float]] | PackedRows = Field(
        description=f"one row per token: weights over the visual items ({ATTENTION_DECIMALS} decimals); packed "
                    "(PackedRows) when the request asked for attention_format=float16-base64")
    attention_kind: str
    extras: dict[str, Any] = Field(default_factory=dict, description="model-specific maps, one row per token "
                                   "(packed as PackedRows, like `attention`, for attention_format=float16-base64)")
    area_boxes: list[list[int]] | None = Field(
        None, description="area-attention models: the grid-cell box (r1, c1, r2, c2, inclusive) of every column of "
                          "extras.areas, for drawing the top-k areas")

    @classmethod
    def of(cls, result: CaptionResult, result_id: str | None = None,
           attention_format: AttentionFormat = "json") -> "CaptionOut":
        return cls(**_caption_fields(result, result_id, _map_writer(attention_format, _rows)))


def _caption_fields(result: CaptionResult, result_id: str | None, rows, geometry=None) -> dict[str, Any]:
    """The fields of :class:`CaptionOut`, in its order, with the attention maps made by ``rows`` (a tensor → what
    the encoder writes) and the geometry by ``geometry`` (default: :meth:`GeometryOut.of`)."""
    hyp = result.hypothesis
    return dict(
        id=result_id, model=result.model, checkpoint=PurePath(result.checkpoint).name, beam_size=result.beam_size,
        **dataclasses.asdict(result.rules),
        caption=result.caption, tokens=result.tokens, is_eos=hyp.is_eos,
        token_logprobs=[round(v, LOGPROB_DECIMALS) for v in hyp.token_logprobs],
        score=round(hyp.score, LOGPROB_DECIMALS), geometry=(geometry or GeometryOut.of)(result.geometry),
        attention=rows(hyp.attention), attention_kind=result.attention_kind,
        extras={name: rows(value) for name, value in hyp.extras.items()},
        area_boxes=result.area_boxes.tolist() if result.area_boxes is not None else None)


def caption_json(result: CaptionResult, result_id: str | None = None,
                 attention_format: AttentionFormat = "json") -> bytes:
    """:class:`CaptionOut` as JSON, written by orjson without building the pydantic model: the same fields and
    values, but the attention maps are written as the float32 numbers they are, shortest form (``0.123457``, not
    the 17 digits of the float32 widened to a double, ``0.12345699965953827``): the same float32 values in half
    the bytes, and the encoder never visits a Python float (docs/decisions.md#serving-overhead-issue-30)."""
    fields = _caption_fields(result, result_id, _map_writer(attention_format, lambda values: _rounded(values).numpy()),
                             GeometryOut.fields)
    return orjson.dumps(fields, option=orjson.OPT_SERIALIZE_NUMPY)


class DecodingOut(Answer):
    """The decoding rules a model's requests get unless they name their own (models/decoding.py, DecodingRules)."""

    length_penalty: float = Field(description="GNMT length penalty α (0: none)")
    block_trigrams: bool = Field(description="no word trigram repeated within a caption")
    block_doubled_words: bool = Field(description="no word right after itself")


class ModelOut(Answer):
    name: str
    architecture: str
    attention_kind: str
    attention: str
    vocab_size: int
    checksum: str
    encoder: dict[str, Any]
    parameters: int
    device: str
    backend: str = Field("torch", description="torch, onnx, or hybrid (the CNN on ONNX Runtime, the decoder on "
                                              "PyTorch)")
    trained_on: str = Field("", description="the data set the checkpoint was trained on (its model card cites it)")
    decoding: DecodingOut = Field(description="the decoding options a request gets unless it names its own, chosen "
                                              "on validation data")
    providers: list[str] | None = Field(None, description="ONNX Runtime execution providers, in priority order")
    heatmap_modes: list[str] = Field(default_factory=list, description="the overlay modes its captions can be drawn "
                                     "in (area_topk: models with decoder area attention only)")
    default: bool = False

    @classmethod
    def of(cls, info: ModelInfo, default: bool) -> "ModelOut":
        return cls(**dataclasses.asdict(info), default=default)


class Health(Answer):
    status: str
    models: list[str] = []


class HeatmapOut(Answer):
    token: str
    index: int
    heat_png: str = Field(description="base64 PNG: 8-bit grayscale heatmap at the (downscaled) image size, 255 at "
                                      "the row's peak when that peak holds at least twice the uniform share, fainter "
                                      "for a flatter row and black for a uniform one (docs/heatmaps.md)")


class HeatmapsOut(Answer):
    id: str = Field(description="result id")
    mode: str
    size: list[int] = Field(description="(width, height) of the heatmaps")
    heatmaps: list[HeatmapOut]

    @classmethod
    def of(cls, rendered: Heatmaps, result_id: str) -> "HeatmapsOut":
        return cls(id=result_id, mode=rendered.mode, size=list(rendered.size),
                   heatmaps=[HeatmapOut(token=token, index=i, heat_png=base64.b64encode(png).decode())
                             for i, (token, png) in enumerate(zip(rendered.tokens, rendered.maps))])
