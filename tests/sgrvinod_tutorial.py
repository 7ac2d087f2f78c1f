"""sgrvinod's "a-PyTorch-Tutorial-to-Image-Captioning" re-created from its code as published (``models.py``:
``Encoder``, ``Attention``, ``DecoderWithAttention``; ``caption.py``: the image preprocessing and one decoding
step of ``caption_image_beam_search``; ``utils.py``: ``save_checkpoint`` and the word map of
``create_input_files``), for the tests of ``captioner import sgrvinod``.

Two changes keep the tests small, neither in the structure: the ``Encoder`` takes its torchvision ResNet as an
argument (the tutorial builds ``resnet101(pretrained=True)``; the tests pass a random ``resnet18``, whose
children and keys have the same layout), and the widths are small.  The classes live in a module named
``models``, as the tutorial's ``train.py`` imports them, so that a pickle of them names the module ``models`` and
the classes exactly as a released ``BEST_checkpoint_*.pth.tar`` does.
"""

from __future__ import annotations

import json
import sys
import types
import warnings
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
import torchvision
from PIL import Image
from torch import nn


class Encoder(nn.Module):
    """The tutorial's ``Encoder``: the ResNet's children but the last two, adaptive average pooling, NHWC."""

    def __init__(self, encoded_image_size=14, resnet=None):
        super(Encoder, self).__init__()
        self.enc_image_size = encoded_image_size
        resnet = resnet if resnet is not None else torchvision.models.resnet101(weights=None)
        modules = list(resnet.children())[:-2]
        self.resnet = nn.Sequential(*modules)
        self.adaptive_pool = nn.AdaptiveAvgPool2d((encoded_image_size, encoded_image_size))
        self.fine_tune()

    def forward(self, images):
        out = self.resnet(images)
        out = self.adaptive_pool(out)
        out = out.permute(0, 2, 3, 1)
        return out

    def fine_tune(self, fine_tune=True):
        for p in self.resnet.parameters():
            p.requires_grad = False
        for c in list(self.resnet.children())[5:]:
            for p in c.parameters():
                p.requires_grad = fine_tune


class Attention(nn.Module):
    """The tutorial's ``Attention``: ``full_att(relu(encoder_att(a) + decoder_att(h)))``, softmax over the pixels."""

    def __init__(self, encoder_dim, decoder_dim, attention_dim):
        super(Attention, self).__init__()
        self.encoder_att = nn.Linear(encoder_dim, attention_dim)
        self.decoder_att = nn.Linear(decoder_dim, attention_dim)
        self.full_att = nn.Linear(attention_dim, 1)
        self.relu = nn.ReLU()
        self.softmax = nn.Softmax(dim=1)

    def forward(self, encoder_out, decoder_hidden):
        att1 = self.encoder_att(encoder_out)
        att2 = self.decoder_att(decoder_hidden)
        att = self.full_att(self.relu(att1 + att2.unsqueeze(1))).squeeze(2)
        alpha = self.softmax(att)
        attention_weighted_encoding = (encoder_out * alpha.unsqueeze(2)).sum(dim=1)
        return attention_weighted_encoding, alpha


class DecoderWithAttention(nn.Module):
    """The tutorial's ``DecoderWithAttention`` (its ``decoder_layers`` argument is the LSTMCell's third positional
    argument, ``bias``, as published)."""

    def __init__(self, attention_dim, embed_dim, decoder_dim, vocab_size, decoder_layers=1, encoder_dim=2048,
                 dropout=0.5):
        super(DecoderWithAttention, self).__init__()
        self.encoder_dim = encoder_dim
        self.attention_dim = attention_dim
        self.embed_dim = embed_dim
        self.decoder_dim = decoder_dim
        self.vocab_size = vocab_size
        self.decoder_layers = decoder_layers
        self.dropout = dropout
        self.attention = Attention(encoder_dim, decoder_dim, attention_dim)
        self.embedding = nn.Embedding(vocab_size, embed_dim)
        self.dropout = nn.Dropout(p=self.dropout)
        self.decode_step = nn.LSTMCell(embed_dim + encoder_dim, decoder_dim, decoder_layers)
        self.init_h = nn.Linear(encoder_dim, decoder_dim)
        self.init_c = nn.Linear(encoder_dim, decoder_dim)
        self.f_beta = nn.Linear(decoder_dim, encoder_dim)
        self.sigmoid = nn.Sigmoid()
        self.fc = nn.Linear(decoder_dim, vocab_size)
        self.init_weights()

    def init_weights(self):
        self.embedding.weight.data.uniform_(-0.1, 0.1)
        self.fc.bias.data.fill_(0)
        self.fc.weight.data.uniform_(-0.1, 0.1)

    def init_hidden_state(self, encoder_out):
        mean_encoder_out = encoder_out.mean(dim=1)
        h = self.init_h(mean_encoder_out)
        c = self.init_c(mean_encoder_out)
        return h, c


def word_map(words):
    """``create_input_files``' word map: the words from 1, then ``<unk>``, ``<start>``, ``<end>``; ``<pad>`` = 0."""
    mapping = {k: v + 1 for v, k in enumerate(words)}
    mapping['<unk>'] = len(mapping) + 1
    mapping['<start>'] = len(mapping) + 1
    mapping['<end>'] = len(mapping) + 1
    mapping['<pad>'] = 0
    return mapping


@contextmanager
def tutorial_module():
    """Make the classes importable as the tutorial's module ``models`` while a checkpoint is pickled."""
    module = types.ModuleType("models")
    saved = sys.modules.get("models")
    for cls in (Encoder, Attention, DecoderWithAttention):
        cls.__module__ = "models"
        setattr(module, cls.__name__, cls)
    sys.modules["models"] = module
    try:
        yield module
    finally:
        for cls in (Encoder, Attention, DecoderWithAttention):
            cls.__module__ = __name__
        if saved is None:
            sys.modules.pop("models", None)
        else:
            sys.modules["models"] = saved


def randomise(module, seed, scale=0.3):
    """Random weights (``scale``·N(0, 1)) and, for the ResNet's BatchNorms, random statistics and affine terms of
    moderate size; its convolutions keep torchvision's (seeded) initialisation, so the grid features stay of
    order one and the attention is not one-hot."""
    g = torch.Generator().manual_seed(seed)

    def noise(tensor, size):
        return torch.randn(tensor.shape, generator=g) * size

    with torch.no_grad():
        for name, tensor in module.state_dict().items():
            if not tensor.is_floating_point():
                continue
            if name.endswith("running_var"):
                tensor.copy_(noise(tensor, 0.2).abs() + 0.8)
            elif name.endswith("running_mean") or (tensor.dim() == 1 and ".resnet." in f".{name}"):
                tensor.copy_(noise(tensor, 0.1) + (0.5 if name.endswith(".weight") else 0.0))
            elif not name.startswith("resnet."):
                tensor.copy_(noise(tensor, scale))
    return module


def save_checkpoint(folder, encoder, decoder, words, data_name="flickr8k_5_cap_per_img_5_min_word_freq",
                    legacy=False):
    """``utils.save_checkpoint`` (the whole modules and their Adam optimizers pickled) and the word map JSON, as
    ``train.py`` leaves them: ``BEST_checkpoint_<data_name>.pth.tar`` + ``WORDMAP_<data_name>.json``."""
    folder = Path(folder)
    encoder_optimizer = torch.optim.Adam(params=filter(lambda p: p.requires_grad, encoder.parameters()), lr=1e-4)
    decoder_optimizer = torch.optim.Adam(params=filter(lambda p: p.requires_grad, decoder.parameters()), lr=4e-4)
    state = {'epoch': 7, 'epochs_since_improvement': 2, 'bleu-4': 0.2315, 'encoder': encoder, 'decoder': decoder,
             'encoder_optimizer': encoder_optimizer, 'decoder_optimizer': decoder_optimizer}
    checkpoint = folder / f"BEST_checkpoint_{data_name}.pth.tar"
    with tutorial_module(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the legacy format would store the classes' source: not found here
        torch.save(state, checkpoint, _use_new_zipfile_serialization=not legacy)
    wordmap = folder / f"WORDMAP_{data_name}.json"
    wordmap.write_text(json.dumps(word_map(words)))
    return checkpoint, wordmap


def preprocess(image: Image.Image) -> torch.Tensor:
    """``caption_image_beam_search``'s image path: resize to 256×256 (``imresize``: PIL, bilinear), ``/255``,
    ImageNet normalisation; ``[1, 3, 256, 256]``."""
    img = np.asarray(image.convert("RGB").resize((256, 256), Image.BILINEAR))
    img = img.transpose(2, 0, 1) / 255.
    img = torch.FloatTensor(img)
    mean = torch.tensor([0.485, 0.456, 0.406])[:, None, None]
    std = torch.tensor([0.229, 0.224, 0.225])[:, None, None]
    return ((img - mean) / std).unsqueeze(0)


@torch.no_grad()
def reference_steps(encoder, decoder, image, tokens):
    """Log-probabilities ``[T, V]`` and attention ``[T, P]`` of ``caption_image_beam_search``'s loop body for one
    image, feeding ``tokens[t]`` (the tutorial's ids, ``<start>`` first) at step ``t``."""
    encoder.eval()
    decoder.eval()
    encoder_out = encoder(preprocess(image))
    encoder_dim = encoder_out.size(3)
    encoder_out = encoder_out.view(1, -1, encoder_dim)
    h, c = decoder.init_hidden_state(encoder_out)
    logprobs, alphas = [], []
    for word in tokens:
        embeddings = decoder.embedding(torch.tensor([word]))
        awe, alpha = decoder.attention(encoder_out, h)
        gate = decoder.sigmoid(decoder.f_beta(h))
        awe = gate * awe
        h, c = decoder.decode_step(torch.cat([embeddings, awe], dim=1), (h, c))
        scores = decoder.fc(h)
        logprobs.append(torch.log_softmax(scores, dim=1)[0])
        alphas.append(alpha[0])
    return torch.stack(logprobs), torch.stack(alphas)
