"""``captioner import sgrvinod``: a checkpoint in the exact format of sgrvinod's "a-PyTorch-Tutorial-to-Image-
Captioning" (its classes re-created from the published code in ``tests/sgrvinod_tutorial.py``, random weights,
small widths, a ResNet-18 trunk where the tutorial has a ResNet-101: same children, same keys) imports into a
model whose log-probabilities and attention equal the tutorial's own forward pass from the image on; the pickle is
read with an allow-list (anything else refused by name); the imported folder serves over HTTP with heatmaps and
batching, and exports to ONNX."""

from __future__ import annotations

import io
import json
import os
import warnings
import zipfile
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import torchvision
from fastapi.testclient import TestClient
from PIL import Image
from skimage import data

from captioner.models.checkpoint import load_checkpoint
from captioner.models.encoder import GridEncoder, preprocess
from captioner.models.interop.common import ConversionError
from captioner.models.interop.safe_pickle import UnsafePickleError
from captioner.models.interop.sgrvinod import ENCODER_FILE, TutorialUnpickler, _trunk, convert_sgrvinod
from captioner.models.protocol import VisualBatch
from captioner.service.app import create_app
from captioner.service.cli import main as captioner
from captioner.service.settings import Settings

from . import sgrvinod_tutorial as tutorial
from .conftest import module_folder
from .serving_helpers import parse_metrics

pytestmark = pytest.mark.usefixtures("one_thread")

WORDS = ["a", "cat", "on", "grass", "red", "sitting", "sofa"]
ATTENTION_DIM, EMBED_DIM, DECODER_DIM, GRID = 8, 6, 10, 14
SPECIAL = {"<start>": "<bos>", "<end>": "<eos>"}  # the tutorial's → ours; <pad> and <unk> are spelled alike


def tutorial_modules(seed=0):
    torch.manual_seed(seed)  # the trunk's convolutions keep torchvision's (seeded) initialisation
    encoder = tutorial.randomise(tutorial.Encoder(GRID, torchvision.models.resnet18(weights=None)), seed)
    decoder = tutorial.DecoderWithAttention(ATTENTION_DIM, EMBED_DIM, DECODER_DIM, len(WORDS) + 4, encoder_dim=512)
    return encoder, tutorial.randomise(decoder, seed + 1, scale=0.6)


@pytest.fixture(scope="module")
def modules():
    return tutorial_modules()


@pytest.fixture(scope="module")
def files(request, modules, tmp_path_factory):
    return tutorial.save_checkpoint(module_folder(request, tmp_path_factory, "tutorial"), *modules, WORDS)


@pytest.fixture(scope="module")
def imported(request, files, tmp_path_factory):
    """The CLI's import, as a user runs it: ``captioner import sgrvinod CHECKPOINT WORDMAP --out weights/NAME``."""
    out = module_folder(request, tmp_path_factory, "weights") / "sat-tutorial"
    captioner(["import", "sgrvinod", *map(str, files), "--out", str(out)])
    return out


def photo():
    return Image.fromarray(data.chelsea())


def teacher_forced(model, vocab, spec, image, their_tokens):
    """Our log-probabilities ``[T, V]`` (columns in the tutorial's word order) and attention ``[T, P]`` for the
    tutorial's token ids, through the project's one image path: ``preprocess`` → ``GridEncoder`` → ``step``."""
    word_map = tutorial.word_map(WORDS)
    words = {index: word for word, index in word_map.items()}
    ours = [vocab.stoi[SPECIAL.get(words[t], words[t])] for t in their_tokens]
    columns = [vocab.stoi[SPECIAL.get(words[i], words[i])] for i in range(len(word_map))]
    with torch.no_grad():
        enc = model.encode(VisualBatch.from_features(GridEncoder(spec)(preprocess(image, spec)[0][None])))
        state, logprobs, attention = model.init_state(enc), [], []
        for token in ours:
            step, state, record = model.step(torch.tensor([token]), state, enc)
            logprobs.append(step[0, columns])
            attention.append(record.primary[0])
    return torch.stack(logprobs), torch.stack(attention)


def their_tokens():
    word_map = tutorial.word_map(WORDS)
    return [word_map[w] for w in ("<start>", "a", "cat", "sitting", "on", "<unk>", "red", "sofa")]


def assert_same_as_the_tutorial(modules, model, vocab, spec):
    image = photo()
    theirs, their_attention = tutorial.reference_steps(*modules, image, their_tokens())
    mine, my_attention = teacher_forced(model, vocab, spec, image, their_tokens())
    torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-5)
    torch.testing.assert_close(my_attention, their_attention, rtol=0, atol=1e-5)
    # the comparison means something: the words are not uniform and the attention is not
    assert theirs.exp().max() > 2 / len(vocab) and their_attention.max() > 2 / GRID ** 2


def test_imported_checkpoint_equals_the_tutorials_forward_pass(modules, imported):
    ckpt = load_checkpoint(imported)
    assert (imported / ENCODER_FILE).is_file() and ckpt.encoder.weights == str((imported / ENCODER_FILE).resolve())
    assert (ckpt.encoder.backbone, ckpt.encoder.pooled_grid, ckpt.encoder.image_size) == ("resnet18", GRID, 256)
    assert ckpt.model.config()["gate"] == "channel" and ckpt.model.config()["output"] == "hidden"
    assert ckpt.meta["imported_from"]["bleu-4"] == 0.2315
    assert_same_as_the_tutorial(modules, ckpt.model, ckpt.vocab, ckpt.encoder)


def test_the_import_says_to_caption_images_with_the_checkpoint_not_to_evaluate_it(files, tmp_path, capsys):
    """The tutorial's checkpoint takes images, like the shipped ones: the import's closing line tells the user the
    command that runs it (``captioner caption IMAGE --checkpoint OUT``) and its trunk, never the region-feature
    ``captioner eval ... --features regions:DIR`` hint of the region-feature importers (features it does not read)."""
    out = tmp_path / "sat-tutorial"
    captioner(["import", "sgrvinod", *map(str, files), "--out", str(out)])
    said = capsys.readouterr().out
    assert said.startswith(f"wrote {out} (sat, {len(WORDS) + 4} tokens, resnet18 encoder); caption with captioner ")
    assert said.endswith(f" caption IMAGE --checkpoint {out}, or serve its folder\n") and "captioner eval" not in said


def test_the_metadata_names_the_source_files_and_keeps_the_checkpoints_numbers(files):
    """The model card shows where the weights came from: the code, the two files' names (never a path of the
    importing machine) and the checkpoint's own epoch and BLEU-4."""
    meta = convert_sgrvinod(*files)[4]
    assert meta["imported_from"] == {"code": "github.com/sgrvinod/a-PyTorch-Tutorial-to-Image-Captioning",
                                     "checkpoint": files[0].name, "word_map": files[1].name, "epoch": 7,
                                     "epochs_since_improvement": 2, "bleu-4": 0.2315}


def test_a_decoder_trained_with_data_parallel_imports_the_same(modules, files, tmp_path):
    wrapped = tutorial.save_checkpoint(tmp_path, *map(torch.nn.DataParallel, modules), WORDS)
    plain, parallel = convert_sgrvinod(*files)[0], convert_sgrvinod(*wrapped)[0]
    for (name, mine), theirs in zip(plain.state_dict().items(), parallel.state_dict().values()):
        assert torch.equal(mine, theirs), name


def test_files_of_pytorch_before_1_6_import_too(modules, tmp_path):
    checkpoint, word_map = tutorial.save_checkpoint(tmp_path, *modules, WORDS, legacy=True)
    model, vocab, spec, trunk, _ = convert_sgrvinod(checkpoint, word_map)
    torch.save(trunk, tmp_path / "trunk.pth")
    assert_same_as_the_tutorial(modules, model, vocab, spec.__class__(**{**spec.to_json(),
                                                                         "weights": str(tmp_path / "trunk.pth")}))


def test_importing_a_file_of_pytorch_before_1_6_warns_of_nothing(modules, tmp_path):
    """A file of PyTorch before 1.6 holds the source of every class it pickled, and torch.load compares it with the
    class it reads it into (our stand-ins, never the same): a SourceChangeWarning per class, noise to whoever runs
    ``captioner import sgrvinod`` on the released checkpoint."""
    files = tutorial.save_checkpoint(tmp_path, *modules, WORDS, legacy=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        convert_sgrvinod(*files)


class Exploit:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_the_pickle_is_allow_listed(modules, files, tmp_path):
    with tutorial.tutorial_module():
        torch.save({"encoder": modules[0], "decoder": modules[1], "extra": Exploit()}, tmp_path / "evil.pth.tar")
    with pytest.raises(UnsafePickleError, match=r"(posix|os)\.system"):
        convert_sgrvinod(tmp_path / "evil.pth.tar", files[1])
    with pytest.raises(SystemExit) as refused:  # the CLI: one line naming the global, nothing written
        captioner(["import", "sgrvinod", str(tmp_path / "evil.pth.tar"), str(files[1]), "--out", str(tmp_path / "o")])
    message = str(refused.value)
    assert message.startswith("error: refusing to load ") and "system" in message and "\n" not in message
    assert not (tmp_path / "o").exists()
    with pytest.raises(UnsafePickleError, match="torch.optim.sgd.SGD"):  # only the tutorial's Adam is expected
        with tutorial.tutorial_module():
            torch.save({"encoder": modules[0], "decoder": modules[1],
                        "decoder_optimizer": torch.optim.SGD(modules[1].parameters(), lr=0.1)}, tmp_path / "sgd.tar")
        convert_sgrvinod(tmp_path / "sgd.tar", files[1])


class Scripted(torch.nn.Module):
    def forward(self, x: int) -> int:
        return x


# the archive is built with TorchScript, which PyTorch deprecates: what an attacker's file is made with, not ours
@pytest.mark.filterwarnings("ignore:`torch.jit:FutureWarning")
def test_a_torchscript_archive_is_refused_before_its_code_can_run(files, tmp_path, monkeypatch):
    """torch.load hands a TorchScript archive to torch.jit.load past the restricted unpickler, and its
    ``__setstate__`` ran: a crafted "checkpoint" wrote a file of its choosing before the import failed (the ONNX and
    importers audit)."""
    torch.jit.save(torch.jit.script(Scripted()), tmp_path / "BEST_checkpoint_x.pth.tar")
    monkeypatch.setattr(torch.jit, "load", lambda *args, **kwargs: pytest.fail("the archive was loaded"))
    with pytest.raises(UnsafePickleError, match="is a TorchScript archive"):
        convert_sgrvinod(tmp_path / "BEST_checkpoint_x.pth.tar", files[1])
    with pytest.raises(SystemExit) as refused:
        captioner(["import", "sgrvinod", str(tmp_path / "BEST_checkpoint_x.pth.tar"), str(files[1]), "--out",
                   str(tmp_path / "o")])
    assert str(refused.value).startswith("error: refusing to load ") and not (tmp_path / "o").exists()


@pytest.mark.filterwarnings("ignore:`torch.jit:FutureWarning")
def test_a_torchscript_archive_without_its_code_folder_is_refused_too(files, tmp_path, monkeypatch):
    """torch.load hands any zip holding a ``constants.pkl`` to torch.jit.load, code folder or not: an archive
    stripped of ``code/`` is refused on its constants alone."""
    torch.jit.save(torch.jit.script(Scripted()), tmp_path / "scripted.pt")
    with zipfile.ZipFile(tmp_path / "scripted.pt") as scripted, \
            zipfile.ZipFile(tmp_path / "BEST_checkpoint_x.pth.tar", "w") as stripped:
        for name in scripted.namelist():
            if "/code/" not in name:
                stripped.writestr(name, scripted.read(name))
    monkeypatch.setattr(torch.jit, "load", lambda *args, **kwargs: pytest.fail("the archive was loaded"))
    with pytest.raises(UnsafePickleError, match="is a TorchScript archive"):
        convert_sgrvinod(tmp_path / "BEST_checkpoint_x.pth.tar", files[1])


def test_a_file_of_pytorch_0_4_which_pickled_parameters_by_their_class_imports(modules, tmp_path, monkeypatch):
    """PyTorch 0.4 (the tutorial's released checkpoint) pickled a parameter as Parameter(tensor, requires_grad),
    a class the allow-list refused."""
    monkeypatch.setattr(torch.nn.Parameter, "__reduce_ex__",
                        lambda self, protocol: (torch.nn.Parameter, (self.data, self.requires_grad)))
    checkpoint, word_map = tutorial.save_checkpoint(tmp_path, *modules, WORDS, legacy=True)
    monkeypatch.undo()
    model, vocab, spec, trunk, _ = convert_sgrvinod(checkpoint, word_map)
    torch.save(trunk, tmp_path / "trunk.pth")
    assert_same_as_the_tutorial(modules, model, vocab, spec.__class__(**{**spec.to_json(),
                                                                         "weights": str(tmp_path / "trunk.pth")}))


def test_a_stand_in_keeps_the_state_pickle_builds_it_with_dict_or_slots():
    """pickle's BUILD hands ``__setstate__`` an object's ``__dict__``, or a ``(__dict__, slots)`` pair for a class
    with ``__slots__`` (either half may be None): a stand-in keeps every attribute of both halves, and a dict of
    two entries is a dict, not a pair."""
    linear = TutorialUnpickler.allowed[("torch.nn.modules.linear", "Linear")]
    for state, kept in ((({"_parameters": {}}, {"in_features": 3}), {"_parameters": {}, "in_features": 3}),
                        ((None, {"in_features": 3}), {"in_features": 3}), (({"training": False}, None),
                                                                           {"training": False}),
                        ({"training": False, "in_features": 3}, {"training": False, "in_features": 3})):
        stand_in = linear.__new__(linear)
        stand_in.__setstate__(state)
        assert stand_in.state == kept, state


def test_foreign_files_are_refused_with_a_reason(files, tmp_path):
    word_map = tutorial.word_map(WORDS[:-1])
    (tmp_path / "short.json").write_text(__import__("json").dumps(word_map))
    with pytest.raises(ConversionError, match="does not belong to this checkpoint"):
        convert_sgrvinod(files[0], tmp_path / "short.json")
    torch.save({"decoder": torch.zeros(2)}, tmp_path / "state.pth")
    with pytest.raises(ConversionError, match="not a tutorial checkpoint"):
        convert_sgrvinod(tmp_path / "state.pth", files[1])
    (tmp_path / "torn.pth.tar").write_bytes(files[0].read_bytes()[:5000])
    with pytest.raises(ConversionError, match="cannot be read"):
        convert_sgrvinod(tmp_path / "torn.pth.tar", files[1])


def test_a_checkpoint_path_that_is_not_there_or_is_a_folder_is_the_os_error(files, tmp_path):
    """A mistyped path, or the training folder given for its BEST_checkpoint_*.pth.tar, is the OS's error, which
    ``captioner import`` reports as such: not a file said to be unreadable as a tutorial checkpoint, which sends the
    user looking at a file's format (as the AoANet importer's test holds for its weights)."""
    with pytest.raises(FileNotFoundError):
        convert_sgrvinod(tmp_path / "BEST_checkpoint_missing.pth.tar", files[1])
    with pytest.raises(IsADirectoryError):
        convert_sgrvinod(tmp_path, files[1])


def test_a_module_holding_something_else_than_a_tensor_or_a_module_is_refused_naming_it(files, tmp_path):
    """The pickle is data a crafted file chooses: a list where a module keeps its tensors or its children is named,
    not an AttributeError from deep in the conversion."""
    encoder, decoder = tutorial_modules(seed=1)
    for holder, said in ((decoder.fc._buffers, "fc.odd of the pickled torch.nn.modules.linear.Linear is not a tensor"),
                         (decoder._modules, "odd of the pickled models.DecoderWithAttention is not a module")):
        holder["odd"] = [1.0, 2.0]
        with tutorial.tutorial_module():
            torch.save({"encoder": encoder, "decoder": decoder}, tmp_path / "odd.pth.tar")
        del holder["odd"]
        with pytest.raises(ConversionError, match=f"^{said}$"):
            convert_sgrvinod(tmp_path / "odd.pth.tar", files[1])


def test_a_trunk_of_other_shapes_than_torchvisions_resnet_is_refused_naming_them(files, tmp_path):
    """A modified ResNet (here a 5×5 first convolution) has torchvision's children but not its shapes: refused at
    the import, where the encoder's weights file would otherwise fail to load in the service."""
    encoder, decoder = tutorial_modules(seed=1)
    encoder.resnet[0] = torch.nn.Conv2d(3, 64, kernel_size=5, stride=2, padding=2, bias=False)
    with tutorial.tutorial_module():
        torch.save({"encoder": encoder, "decoder": decoder}, tmp_path / "widened.pth.tar")
    with pytest.raises(ConversionError, match=r"does not fit torchvision's resnet18 .*: missing \[\], unknown \[\], "
                                              r"misshapen \['conv1\.weight'\]$"):
        convert_sgrvinod(tmp_path / "widened.pth.tar", files[1])


def test_a_trunk_without_some_of_torchvisions_tensors_is_refused_naming_them(files, tmp_path):
    """A BatchNorm without running statistics (``track_running_stats=False``) leaves the trunk short of tensors
    torchvision's ResNet has: refused at the import, not when the service loads the encoder's weights file."""
    encoder, decoder = tutorial_modules(seed=1)
    encoder.resnet[1].running_mean = None
    with tutorial.tutorial_module():
        torch.save({"encoder": encoder, "decoder": decoder}, tmp_path / "no-statistics.pth.tar")
    with pytest.raises(ConversionError, match=r"does not fit torchvision's resnet18 .*: missing "
                                              r"\['bn1\.running_mean'\], unknown \[\], misshapen \[\]$"):
        convert_sgrvinod(tmp_path / "no-statistics.pth.tar", files[1])


def stand_ins(module):
    """The :class:`~captioner.models.interop.sgrvinod.PickledModule` stand-ins the tutorial's unpickler makes of
    ``module``, built without a pickle (a pickle may not hold the meta tensors that keep a ResNet-152 free)."""
    cls = TutorialUnpickler.allowed[(type(module).__module__, type(module).__name__)]
    stand_in = cls.__new__(cls)
    stand_in.__setstate__({**vars(module), "_modules": {name: stand_ins(child)
                                                         for name, child in module._modules.items()}})
    return stand_in


@pytest.mark.parametrize("resnet", ["resnet18", "resnet34", "resnet50", "resnet101", "resnet152"])
def test_every_torchvision_resnet_trunk_is_recognised_by_its_blocks(resnet):
    """The released checkpoint's trunk is a ResNet-101, the tests' files hold a ResNet-18: each of torchvision's
    ResNets is named from its blocks per stage and its keys and shapes checked (on the meta device: no weights)."""
    with torch.device("meta"), tutorial.tutorial_module():
        encoder = stand_ins(tutorial.Encoder(7, getattr(torchvision.models, resnet)(weights=None)))
        backbone, grid, weights = _trunk(encoder)
    assert (backbone, grid) == (resnet, 7) and "layer4.0.conv1.weight" in weights and "fc.weight" not in weights


@pytest.fixture
def meta_encoder():
    """The tutorial's encoder over a ResNet-18 on the meta device (no weights to make), its classes named as the
    tutorial's module; the test runs inside both, so what it builds is on the meta device too."""
    with torch.device("meta"), tutorial.tutorial_module():
        yield tutorial.Encoder(7, torchvision.models.resnet18(weights=None))


def test_a_trunk_pooled_onto_a_grid_that_is_not_square_is_refused(meta_encoder):
    """The encoder spec has one side (``pooled_grid``): a 7×5 pooling would be served as 7×7, attention misplaced."""
    meta_encoder.adaptive_pool = torch.nn.AdaptiveAvgPool2d((7, 5))
    with pytest.raises(ConversionError, match=r"pools onto \(7, 5\): only a square grid is supported"):
        _trunk(stand_ins(meta_encoder))


def test_a_trunk_that_kept_the_resnets_average_pool_is_refused(meta_encoder):
    """The tutorial's trunk is the ResNet's children but the last two: one that kept ``avgpool`` (no weights of its
    own) would pool layer4 to 1×1 before the grid pooling, features the imported model would never be served."""
    meta_encoder.resnet = torch.nn.Sequential(*list(torchvision.models.resnet18(weights=None).children())[:-1])
    with pytest.raises(ConversionError, match=r"not a torchvision ResNet-18/34/50/101/152 \(9 children"):
        _trunk(stand_ins(meta_encoder))


@pytest.mark.parametrize("pool", ["max-pooled", "no pool"])
def test_an_encoder_without_the_tutorials_grid_pooling_is_refused_as_not_the_tutorials(pool, meta_encoder):
    """An edited tutorial whose encoder max-pools, or lost its ``adaptive_pool``, is told its encoder is not the
    tutorial's (trunk + AdaptiveAvgPool2d): not that its grid is not square, nor an AttributeError's traceback."""
    meta_encoder.adaptive_pool = torch.nn.MaxPool2d(2)
    encoder = stand_ins(meta_encoder)
    if pool == "no pool":
        del encoder.state["_modules"]["adaptive_pool"]
    with pytest.raises(ConversionError, match=r"not the tutorial's \(resnet trunk \+ AdaptiveAvgPool2d\)"):
        _trunk(encoder)


def test_a_trunk_holding_weights_where_a_resnet_has_none_is_refused_naming_the_child(meta_encoder):
    """A ResNet's children 2 and 3 (ReLU, max-pool) hold no weights: an edited tutorial that put a layer there has a
    trunk the service could not rebuild, and is told which child, not met with a KeyError's traceback."""
    meta_encoder.resnet[3] = torch.nn.BatchNorm2d(64)
    with pytest.raises(ConversionError, match="holds weights in child 3, which a ResNet has not"):
        _trunk(stand_ins(meta_encoder))


def test_a_grid_pooling_given_as_one_number_is_read_as_square(meta_encoder):
    """``nn.AdaptiveAvgPool2d(7)`` keeps ``output_size`` as the int 7, which means 7×7 (a tutorial edited to pool
    so imports as it would run)."""
    meta_encoder.adaptive_pool = torch.nn.AdaptiveAvgPool2d(7)
    assert _trunk(stand_ins(meta_encoder))[:2] == ("resnet18", 7)


def test_a_trunk_pooled_onto_one_cell_imports_and_onto_none_is_refused(meta_encoder):
    """The tutorial's ``encoded_image_size`` may be 1 (the pooled image as one vector, which the encoder spec
    serves): its checkpoint imports with a 1×1 grid rather than being told its grid is not square; a pooling onto
    0×0 cells, which gives no features at all, is refused naming it."""
    meta_encoder.adaptive_pool = torch.nn.AdaptiveAvgPool2d(1)
    assert _trunk(stand_ins(meta_encoder))[:2] == ("resnet18", 1)
    meta_encoder.adaptive_pool = torch.nn.AdaptiveAvgPool2d((0, 0))
    with pytest.raises(ConversionError, match=r"pools onto \(0, 0\): only a square grid is supported"):
        _trunk(stand_ins(meta_encoder))


def test_a_checkpoint_whose_encoder_and_decoder_are_swapped_is_refused_naming_both(modules, files, tmp_path):
    with tutorial.tutorial_module():
        torch.save({"encoder": modules[1], "decoder": modules[0]}, tmp_path / "swapped.pth.tar")
    with pytest.raises(ConversionError, match="'encoder' is a models.DecoderWithAttention, not the tutorial's "
                                              "models.Encoder"):
        convert_sgrvinod(tmp_path / "swapped.pth.tar", files[1])


def test_a_decoder_without_a_tensor_of_the_tutorials_is_refused_naming_it(files, tmp_path):
    encoder, decoder = tutorial_modules(seed=1)
    del decoder.embedding
    with tutorial.tutorial_module():
        torch.save({"encoder": encoder, "decoder": decoder}, tmp_path / "no-embedding.pth.tar")
    with pytest.raises(ConversionError, match="^the decoder lacks 'embedding.weight': not the tutorial's "
                                              "DecoderWithAttention$"):
        convert_sgrvinod(tmp_path / "no-embedding.pth.tar", files[1])


def test_a_checkpoint_of_the_released_proportions_imports_the_same(tmp_path):
    """The released checkpoint's attention and decoder widths are equal (512 and 512): a ``decoder_att`` weight
    read transposed would load without a shape error. Its grid may be other than 14×14 and its dropout other than
    0.5 (``encoded_image_size`` and ``dropout`` are the tutorial's options): each reaches the imported model."""
    torch.manual_seed(2)
    encoder = tutorial.randomise(tutorial.Encoder(7, torchvision.models.resnet18(weights=None)), 2)
    decoder = tutorial.randomise(tutorial.DecoderWithAttention(DECODER_DIM, EMBED_DIM, DECODER_DIM, len(WORDS) + 4,
                                                               encoder_dim=512, dropout=0.3), 3, scale=0.6)
    model, vocab, spec, trunk, _ = convert_sgrvinod(*tutorial.save_checkpoint(tmp_path, encoder, decoder, WORDS))
    assert spec.pooled_grid == 7 and model.config()["dropout"] == 0.3
    torch.save(trunk, tmp_path / "trunk.pth")
    spec = spec.__class__(**{**spec.to_json(), "weights": str(tmp_path / "trunk.pth")})
    assert_same_as_the_tutorial((encoder, decoder), model, vocab, spec)


def test_a_word_map_that_is_not_the_tutorials_is_refused_with_a_reason(files, tmp_path):
    word_map = tutorial.word_map(WORDS)
    for name, content, said in (
            ("list.json", list(word_map), "is not a word map"),
            ("strings.json", {word: str(index) for word, index in word_map.items()}, "is not a word map"),
            ("flag.json", {**word_map, "a": True}, "is not a word map"),
            ("no-unk.json", {word: index for word, index in word_map.items() if word != "<unk>"},
             r"lacks the tutorial's special token\(s\) \['<unk>'\]"),
            # as many words as rows, but two on one row and none on another: "sofa" would score as "cat"
            ("repeated.json", {**word_map, "sofa": word_map["cat"]}, r"repeats or skips an index"),
            ("ours.json", {("<bos>" if word == "sofa" else word): index for word, index in word_map.items()},
             r"holds \['<bos>'\], which are this project's special tokens"),
            # a word spelled <eos> would be read as our <eos>, in place of the tutorial's <end>
            ("eos.json", {("<eos>" if word == "sofa" else word): index for word, index in word_map.items()},
             r"holds \['<eos>'\], which are this project's special tokens")):
        (tmp_path / name).write_text(json.dumps(content))
        with pytest.raises(ConversionError, match=said):
            convert_sgrvinod(files[0], tmp_path / name)
    (tmp_path / "torn.json").write_text(json.dumps(word_map)[:-9])  # a copy cut short: a reason, not a traceback
    with pytest.raises(ConversionError, match="torn.json is not a JSON word map"):
        convert_sgrvinod(files[0], tmp_path / "torn.json")


def jpeg(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=92)
    return buffer.getvalue()


def serve(folder, **settings):
    return TestClient(create_app(Settings(weights_dir=folder.parent, default_model=folder.name, device="cpu",
                                          threads=1, warmup=False, **settings)))


def test_imported_checkpoint_serves_heatmaps_and_batches_over_http(imported):
    images = [jpeg(Image.fromarray(array).resize((160, 120))) for array in
              (data.chelsea(), data.astronaut(), data.coffee(), data.rocket())]
    with serve(imported, backend="torch", max_batch_images=4) as client:
        solo = [client.post("/caption", params={"beam_size": 2, "max_len": 6},
                            files={"file": ("x.jpg", image, "image/jpeg")}) for image in images]
        assert all(response.status_code == 200 for response in solo), solo[0].text
        first = solo[0].json()
        assert first["geometry"]["grid_hw"] == [GRID, GRID] and first["attention_kind"] == "soft_attention"
        assert len(first["attention"]) == len(first["tokens"]) and len(first["attention"][0]) == GRID * GRID
        assert np.allclose(np.sum(first["attention"], 1), 1, atol=1e-4)
        overlay = client.post("/caption/overlay", params={"format": "png", "token": 0, "max_len": 6},
                              files={"file": ("x.jpg", images[0], "image/jpeg")})
        assert overlay.status_code == 200 and Image.open(io.BytesIO(overlay.content)).size == (160, 120)

        def one(image):
            return client.post("/caption", params={"beam_size": 2, "max_len": 6},
                               files={"file": ("x.jpg", image, "image/jpeg")})

        before = parse_metrics(client.get("/metrics").text)
        with ThreadPoolExecutor(len(images) * 2) as pool:  # everyone at once: the batcher mixes them
            together = list(pool.map(one, images * 2))
        after = parse_metrics(client.get("/metrics").text)
        for response, alone in zip(together, solo * 2):
            assert response.json()["caption"] == alone.json()["caption"]
            np.testing.assert_allclose(response.json()["attention"], alone.json()["attention"], atol=1e-5)
            np.testing.assert_allclose(response.json()["token_logprobs"], alone.json()["token_logprobs"], atol=1e-4)
    # a step of more than 2 rows (the beam) decoded several requests together
    key, bucket = f'{{model="{imported.name}"}}', f'captioner_rows_per_step_bucket{{le="2.0",model="{imported.name}"}}'
    steps = after[f"captioner_rows_per_step_count{key}"] - before[f"captioner_rows_per_step_count{key}"]
    assert steps - (after[bucket] - before[bucket]) > 0, "concurrent requests shared decoding steps"


def test_imported_checkpoint_exports_to_onnx_and_serves_the_same_captions(imported, tmp_path):
    image = jpeg(photo())
    answers = {}
    for backend in ("torch", "onnx"):
        with serve(imported, backend=backend, onnx_dir=tmp_path / "onnx") as client:
            model = {m["name"]: m for m in client.get("/models").json()}[imported.name]
            assert model["backend"] == backend
            answers[backend] = client.post("/caption", params={"beam_size": 3, "max_len": 8},
                                           files={"file": ("x.jpg", image, "image/jpeg")}).json()
    assert answers["onnx"]["caption"] == answers["torch"]["caption"]
    np.testing.assert_allclose(answers["onnx"]["attention"], answers["torch"]["attention"], atol=1e-4)
    np.testing.assert_allclose(answers["onnx"]["token_logprobs"], answers["torch"]["token_logprobs"], atol=1e-3)
    assert (tmp_path / "onnx" / imported.name).is_dir()
