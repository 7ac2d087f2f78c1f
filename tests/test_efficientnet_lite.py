"""The project's EfficientNet-Lite against timm's ``tf_efficientnet_lite*``, the reference it replaces (timm is a
dev dependency only): the same tensors under the same names in the same order, the same outputs, and a grid encoder
that imports neither timm nor what timm imports."""

import subprocess
import sys

import pytest
import timm
import torch

from captioner.models.efficientnet_lite import DepthwiseSeparable, EfficientNetLiteNet, InvertedResidual, SameConv2d
from captioner.models.encoder import EFFICIENTNET_LITE


def _random_pair(variant: str, seed: int = 0):
    """timm's network and ours with the same random weights and BatchNorm statistics, each convolution's scaled by
    its fan-in so that the input's pattern, not the BatchNorm offsets, reaches the last stage."""
    spec = EFFICIENTNET_LITE[variant]
    reference = timm.create_model(f"tf_{variant}", pretrained=False).eval()
    ours = EfficientNetLiteNet(spec.stage_channels, spec.stage_repeats, spec.head_channels).eval()
    generator = torch.Generator().manual_seed(seed)

    def draw(name: str, value: torch.Tensor) -> torch.Tensor:
        noise = torch.randn(value.shape, generator=generator)
        if value.dim() > 1:  # a convolution's or the classifier's: fan-in = the numel of one output's weights
            return noise * (2.0 / value[0].numel()) ** 0.5
        if name.endswith("running_var"):
            return torch.rand(value.shape, generator=generator) + 0.5
        return 1 + 0.1 * noise if name.endswith("weight") else 0.1 * noise  # a BatchNorm's scale; offsets, means

    state = {name: draw(name, value) if value.is_floating_point() else value
             for name, value in reference.state_dict().items()}
    reference.load_state_dict(state)
    ours.load_state_dict(state)
    return reference, ours


@pytest.mark.parametrize("variant", sorted(EFFICIENTNET_LITE))
def test_the_network_holds_timms_tensors_in_timms_order(variant):
    """The packaged weights are mapped by position and fine-tuned stages saved by name: both need timm's layout."""
    spec = EFFICIENTNET_LITE[variant]
    reference = timm.create_model(f"tf_{variant}", pretrained=False).state_dict()
    ours = EfficientNetLiteNet(spec.stage_channels, spec.stage_repeats, spec.head_channels).state_dict()
    assert list(ours) == list(reference)
    assert [tuple(value.shape) for value in ours.values()] == [tuple(value.shape) for value in reference.values()]


@pytest.mark.parametrize("variant", sorted(EFFICIENTNET_LITE))
@pytest.mark.parametrize("size", [(256, 256), (97, 130), (33, 64)])
def test_the_network_computes_timms_features_and_logits(variant, size):
    """Odd sizes too: TensorFlow's SAME padding of the strided convolutions puts the odd pixel at the bottom and
    right, and symmetric padding would shift the grid there."""
    reference, ours = _random_pair(variant)
    pixels = torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want_features, want_logits = reference.forward_features(pixels), reference(pixels)
        features, logits = ours.forward_features(pixels), ours(pixels)
    assert want_features.std((2, 3)).mean() > 0.05  # the pattern of the pixels survives every stage
    torch.testing.assert_close(features, want_features)
    torch.testing.assert_close(logits, want_logits)


def test_the_same_padding_keeps_ceil_of_size_over_stride_cells_and_pads_the_odd_pixel_after():
    conv = SameConv2d(1, 1, 3, 2)
    torch.nn.init.ones_(conv.weight)
    image = torch.arange(1.0, 6.0).reshape(1, 1, 1, 5).expand(1, 1, 5, 5)
    out = conv(image)
    assert out.shape == (1, 1, 3, 3)  # ceil(5 / 2)
    # five columns need two of padding, one a side: the windows are columns 0..1, 1..3 and 3..4 (1-based 1..5)
    assert out[0, 0, 1].tolist() == [3 * (1 + 2), 3 * (2 + 3 + 4), 3 * (4 + 5)]
    even = conv(torch.ones(1, 1, 4, 4))
    # four columns need one: after, so the first window starts on the first pixel and the last takes the pad
    assert even.shape == (1, 1, 2, 2) and even[0, 0].tolist() == [[9.0, 6.0], [6.0, 4.0]]
    with pytest.raises(ValueError, match="kernel 1 smaller than stride 2"):
        SameConv2d(1, 1, 1, 2)
    # a kernel as large as its stride is refused by nothing: its windows tile the image, the odd pixel padded after
    tiling = SameConv2d(1, 1, 2, 2)
    torch.nn.init.ones_(tiling.weight)
    assert tiling(torch.ones(1, 1, 3, 3))[0, 0].tolist() == [[4.0, 2.0], [2.0, 1.0]]


@pytest.mark.parametrize("block, residual", [
    (InvertedResidual(8, 8, 3, 1, 6), True), (InvertedResidual(8, 8, 3, 2, 6), False),
    (InvertedResidual(8, 16, 3, 1, 6), False), (DepthwiseSeparable(8, 8, 3, 1), True),
    (DepthwiseSeparable(8, 8, 3, 2), False)])
def test_a_block_adds_its_input_back_only_where_it_keeps_the_inputs_shape(block, residual):
    """MBConv's skip needs stride 1 and as many channels out as in.  Every strided stage of the variants the encoder
    ships also widens, so the network tests cannot tell a skip that ignores the stride; a block built alone can."""
    pixels = torch.randn(1, 8, 10, 10, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out, transformed = block.eval()(pixels), block.transform(pixels)
    torch.testing.assert_close(out, transformed + pixels if residual else transformed)


def test_a_grid_encoder_imports_neither_timm_nor_torchvision():
    """What replacing timm is for: timm imports torchvision's models and ``torch._dynamo``, about 10 s of a first
    start before any Python file of theirs is byte-compiled."""
    code = ("import sys; from captioner.models.encoder import EncoderSpec, GridEncoder; GridEncoder(EncoderSpec()); "
            "print(sorted(m for m in ('timm', 'torchvision', 'torch._dynamo') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize("channels, repeats", [((16, 24, 40, 80, 112, 192), (1, 2, 2, 3, 3, 4)),
                                               ((16, 24, 40, 80, 112, 192, 320), (1, 2, 2, 3, 3, 4))])
def test_a_variant_table_without_seven_stages_is_refused_not_built_short(channels, repeats):
    """Every variant has the seven stages of the kernel, stride and expansion tables: a table one stage short
    would otherwise build a network without its last stage (and a grid of other features) in silence."""
    with pytest.raises(ValueError):
        EfficientNetLiteNet(channels, repeats)
