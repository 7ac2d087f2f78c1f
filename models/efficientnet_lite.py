"""EfficientNet-Lite (Tan & Le, arXiv:1905.11946, §4 and Table 1's MBConv network with the Lite changes of TensorFlow's
``efficientnet/lite``: no squeeze-and-excitation, ReLU6, the stem and head left unscaled), laid out module for
module as timm's ``tf_efficientnet_lite*``: the packaged ImageNet weights load onto it by position, and the names
of a fine-tuned stage's weights (``blocks.6.0.conv_pw.weight``) are timm's.

Why not timm itself: importing timm imports ``torchvision.models`` for its feature extractor, and with it
``torch._dynamo``, about 10 s of a first start's preparing child (its modules are not byte-compiled yet) and about
190 MB of its memory, for a network this file builds in plain PyTorch (docs/decisions.md, "EfficientNet-Lite without
timm").  timm stays the reference: tests/test_efficientnet_lite.py holds this network to it, tensor for tensor."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

#: per MBConv stage, every variant alike: depthwise kernel, stride of its first block, expansion ratio
STAGE_KERNELS = (3, 3, 5, 3, 5, 5, 3)
STAGE_STRIDES = (1, 2, 2, 2, 1, 2, 1)
STAGE_EXPANSIONS = (1, 6, 6, 6, 6, 6, 6)
STEM_CHANNELS = 32
#: TensorFlow's BatchNorm epsilon, which the weights were trained with (PyTorch's default is 1e-5)
BN_EPS = 1e-3


class SameConv2d(nn.Conv2d):
    """A strided convolution with TensorFlow's ``SAME`` padding: the output has ``ceil(size / stride)`` cells and the
    padding that needs is split with the odd pixel at the bottom and right (PyTorch's symmetric padding would shift
    every cell of the ImageNet weights by a pixel).  It depends on the input's size, so it is computed per call."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int, groups: int = 1):
        if kernel_size < stride:  # then the padding below can be negative, which SAME clamps to zero
            raise ValueError(f"kernel {kernel_size} smaller than stride {stride}")
        super().__init__(in_channels, out_channels, kernel_size, stride, groups=groups, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        pads = []
        for size, kernel, stride in zip(reversed(x.shape[-2:]), reversed(self.kernel_size), reversed(self.stride)):
            total = (-(-size // stride) - 1) * stride + kernel - size  # width first: F.pad's order
            pads += [total // 2, total - total // 2]
        return super().forward(F.pad(x, pads))


def _conv(in_channels: int, out_channels: int, kernel_size: int, stride: int = 1, groups: int = 1) -> nn.Conv2d:
    """A bias-free convolution padded as TensorFlow's ``SAME`` (at stride 1 and an odd kernel: symmetric)."""
    if stride > 1:
        return SameConv2d(in_channels, out_channels, kernel_size, stride, groups)
    return nn.Conv2d(in_channels, out_channels, kernel_size, padding=kernel_size // 2, groups=groups, bias=False)


class BatchNormAct(nn.BatchNorm2d):
    """BatchNorm, then ReLU6 or nothing: one module, as timm's ``BatchNormAct2d``, so that folding the BatchNorm into
    the convolution before it leaves its ``act`` (:func:`~captioner.models.encoder.fold_batch_norm`)."""

    def __init__(self, channels: int, activation: bool = True):
        super().__init__(channels, eps=BN_EPS)
        self.act = nn.ReLU6(inplace=True) if activation else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        return self.act(super().forward(x))


class _Block(nn.Module):
    """A block of a stage: its layers (:meth:`transform`), and the input added back where they keep its shape."""

    def __init__(self, in_channels: int, out_channels: int, stride: int):
        super().__init__()
        self.residual = stride == 1 and in_channels == out_channels

    def transform(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def forward(self, x: Tensor) -> Tensor:
        out = self.transform(x)
        return out + x if self.residual else out


class DepthwiseSeparable(_Block):
    """The first stage's block (expansion 1): depthwise convolution, then a linear pointwise one."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int):
        super().__init__(in_channels, out_channels, stride)
        self.conv_dw = _conv(in_channels, in_channels, kernel_size, stride, groups=in_channels)
        self.bn1 = BatchNormAct(in_channels)
        self.conv_pw = _conv(in_channels, out_channels, 1)
        self.bn2 = BatchNormAct(out_channels, activation=False)

    def transform(self, x: Tensor) -> Tensor:
        return self.bn2(self.conv_pw(self.bn1(self.conv_dw(x))))


class InvertedResidual(_Block):
    """MBConv (Sandler et al., arXiv:1801.04381, Table 1): pointwise expansion, depthwise convolution and a linear
    pointwise projection."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int, expansion: int):
        super().__init__(in_channels, out_channels, stride)
        hidden = in_channels * expansion
        self.conv_pw = _conv(in_channels, hidden, 1)
        self.bn1 = BatchNormAct(hidden)
        self.conv_dw = _conv(hidden, hidden, kernel_size, stride, groups=hidden)
        self.bn2 = BatchNormAct(hidden)
        self.conv_pwl = _conv(hidden, out_channels, 1)
        self.bn3 = BatchNormAct(out_channels, activation=False)

    def transform(self, x: Tensor) -> Tensor:
        return self.bn3(self.conv_pwl(self.bn2(self.conv_dw(self.bn1(self.conv_pw(x))))))


class EfficientNetLiteNet(nn.Module):
    """The network: stem (``conv_stem``, ``bn1``), seven MBConv stages (``blocks``), head (``conv_head``, ``bn2``)
    and ImageNet's ``classifier``, which the captioners never run (the grid encoder takes the stages' maps) but the
    weight file holds, last, and which shows that real weights were loaded.  ``stage_channels`` and
    ``stage_repeats`` are a variant's widths and depths (Lite0: 16…320 and 1, 2, 2, 3, 3, 4, 1)."""

    def __init__(self, stage_channels: tuple[int, ...], stage_repeats: tuple[int, ...], head_channels: int = 1280,
                 classes: int = 1000):
        super().__init__()
        self.conv_stem = _conv(3, STEM_CHANNELS, 3, stride=2)
        self.bn1 = BatchNormAct(STEM_CHANNELS)
        stages, channels = [], STEM_CHANNELS
        for out, repeats, kernel, stride, expansion in zip(stage_channels, stage_repeats, STAGE_KERNELS,
                                                           STAGE_STRIDES, STAGE_EXPANSIONS, strict=True):
            blocks = []
            for index in range(repeats):
                first_stride = stride if index == 0 else 1
                blocks.append(DepthwiseSeparable(channels, out, kernel, first_stride) if expansion == 1
                              else InvertedResidual(channels, out, kernel, first_stride, expansion))
                channels = out
            stages.append(nn.Sequential(*blocks))
        self.blocks = nn.Sequential(*stages)
        self.conv_head = _conv(channels, head_channels, 1)
        self.bn2 = BatchNormAct(head_channels)
        self.classifier = nn.Linear(head_channels, classes)

    def forward_features(self, pixels: Tensor) -> Tensor:
        """The head's feature map ``[B, head_channels, H/32, W/32]``."""
        return self.bn2(self.conv_head(self.blocks(self.bn1(self.conv_stem(pixels)))))

    def forward(self, pixels: Tensor) -> Tensor:
        """ImageNet logits ``[B, classes]``: the head's map averaged over its cells, then the classifier."""
        return self.classifier(self.forward_features(pixels).mean((2, 3)))
