"""``captioner import aoanet``: a checkpoint in the AoANet authors' format (random weights) converts into a model
whose log-probabilities equal a reference forward pass rebuilt here from the authors' code as published
(husthuaan/AoANet, argument order included: ``MultiHeadedDotAttention.forward(query, value, key)``); the infos
pickle is read with an allow-list, never with plain ``pickle.load``; what the model cannot express is refused."""

import argparse
import collections
import io
import math
import os
import pickle
import runpy
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from captioner.models.checkpoint import load_checkpoint
from captioner.models.interop import safe_pickle
from captioner.models.interop.aoanet import ConversionError, convert_aoanet
from captioner.models.interop.common import copy_weights, load_converted, load_torch_weights
from captioner.models.interop.safe_pickle import ALLOWED, UnsafePickleError, restricted_load
from captioner.models.interop.sgrvinod import PickledModule, TutorialUnpickler
from captioner.models.protocol import VisualBatch
from captioner.models.zoo import create
from captioner.service.cli import main as captioner_main

pytestmark = pytest.mark.usefixtures("one_thread")

D, E, FEAT, HEADS, LAYERS = 16, 12, 10, 2, 2
WORDS = ["a", "dog", "UNK", "on", "grass", "red"]  # the authors' ix_to_word numbers them 1..6; 0 is start/end


def authors_state(seed=0):
    """A state dict with the key names and shapes of husthuaan/AoANet's AoAModel (refine=1, use_multi_head=2,
    multi_head_scale=1, decoder_type=AoA, mean_feats=1), random values."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=0.3):
        return torch.randn(*shape, generator=g) * scale

    state = {"embed.0.weight": r(len(WORDS) + 1, E), "att_embed.0.weight": r(D, FEAT), "att_embed.0.bias": r(D),
             "logit.weight": r(len(WORDS) + 1, D), "logit.bias": r(len(WORDS) + 1),
             "ctx2att.weight": r(2 * D, D), "ctx2att.bias": r(2 * D)}
    for i in range(LAYERS):
        p = f"refiner.layers.{i}"
        for j in range(3):
            state[f"{p}.self_attn.linears.{j}.weight"], state[f"{p}.self_attn.linears.{j}.bias"] = r(D, D), r(D)
        state[f"{p}.self_attn.aoa_layer.0.weight"], state[f"{p}.self_attn.aoa_layer.0.bias"] = r(2 * D, 2 * D), r(2 * D)
        state[f"{p}.sublayer.0.norm.a_2"], state[f"{p}.sublayer.0.norm.b_2"] = 1 + r(D), r(D)
    state["refiner.norm.a_2"], state["refiner.norm.b_2"] = 1 + r(D), r(D)
    state["core.att_lstm.weight_ih"], state["core.att_lstm.weight_hh"] = r(4 * D, E + D), r(4 * D, D)
    state["core.att_lstm.bias_ih"], state["core.att_lstm.bias_hh"] = r(4 * D), r(4 * D)
    state["core.att2ctx.0.weight"], state["core.att2ctx.0.bias"] = r(2 * D, 2 * D), r(2 * D)
    state["core.attention.norm.a_2"], state["core.attention.norm.b_2"] = 1 + r(D), r(D)
    state["core.attention.linears.0.weight"], state["core.attention.linears.0.bias"] = r(D, D), r(D)
    return state


# -- the reference: the authors' forward pass, rebuilt from husthuaan/AoANet as published ------------------------
# (models/AoAModel.py, models/TransformerModel.py, models/AttModel.py; argument order included)
def annotated_layer_norm(x, gain, shift, eps=1e-6):
    """Their ``LayerNorm``: ``a_2 * (x - mean) / (std + eps) + b_2`` (unbiased std, ε added to the std)."""
    return gain * (x - x.mean(-1, keepdim=True)) / (x.std(-1, keepdim=True) + eps) + shift


def linear(state, name, x):
    return x @ state[f"{name}.weight"].T + state[f"{name}.bias"]


def transformer_attention(query, key, value):
    """``TransformerModel.attention(query, key, value, mask=None, dropout=None)``."""
    scores = query @ key.transpose(-2, -1) / math.sqrt(query.size(-1))
    return scores.softmax(-1) @ value


def multi_headed_dot_attention(state, prefix, query, value, key, *, project_k_v, norm_q=None, aoa=None):
    """``MultiHeadedDotAttention.forward(self, query, value, key, mask=None)``: note **value before key** in its
    signature.  ``norm_q``: the query LayerNorm's prefix; ``aoa``: the AoA layer's prefix (``do_aoa``); no output
    layer (``use_output_layer=0`` or AoA)."""
    single_query = query.dim() == 2
    if single_query:
        query = query.unsqueeze(1)
    nbatches = query.size(0)
    if norm_q is not None:
        query = annotated_layer_norm(query, state[f"{norm_q}.a_2"], state[f"{norm_q}.b_2"])

    def split(t):
        return t.view(nbatches, -1, HEADS, D // HEADS).transpose(1, 2)
    if project_k_v == 0:
        query_ = split(linear(state, f"{prefix}.linears.0", query))
        key_, value_ = split(key), split(value)
    else:  # zip(self.linears, (query, key, value))
        query_, key_, value_ = (split(linear(state, f"{prefix}.linears.{j}", x))
                                for j, x in enumerate((query, key, value)))
    x = transformer_attention(query_, key_, value_).transpose(1, 2).contiguous().view(nbatches, -1, D)
    if aoa is not None:
        x = F.glu(linear(state, aoa, torch.cat([x, query], -1)), -1)
    return x.squeeze(1) if single_query else x


def lstm_cell(state, x, h, c):
    """PyTorch's LSTMCell (gate order i, f, g, o), which the authors' code uses."""
    gates = (x @ state["core.att_lstm.weight_ih"].T + state["core.att_lstm.bias_ih"]
             + h @ state["core.att_lstm.weight_hh"].T + state["core.att_lstm.bias_hh"])
    i, f, g, o = gates.chunk(4, -1)
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(c), c


def authors_logprobs(state, feats, tokens):
    """Log-probabilities ``[B, T, |words| + 1]`` after feeding ``tokens[:, t]`` (0 = start) at each step:
    ``AoAModel._prepare_feature`` once, then ``AttModel.get_logprobs_state`` → ``AoA_Decoder_Core.forward``."""
    a = F.relu(linear(state, "att_embed.0", feats))
    refined = "refiner.norm.a_2" in state  # with --refine 0 their refiner is `lambda x, y: x` and has no weights
    # AoA_Refiner_Layer: sublayer[0](x, lambda x: self.self_attn(x, x, x, mask))
    for i in range(LAYERS if refined else 0):
        p = f"refiner.layers.{i}"
        x = annotated_layer_norm(a, state[f"{p}.sublayer.0.norm.a_2"], state[f"{p}.sublayer.0.norm.b_2"])
        a = a + multi_headed_dot_attention(state, f"{p}.self_attn", x, x, x, project_k_v=1,
                                           aoa=f"{p}.self_attn.aoa_layer.0")
    if refined:
        a = annotated_layer_norm(a, state["refiner.norm.a_2"], state["refiner.norm.b_2"])
    mean_feats = a.mean(1)
    p_att_feats = linear(state, "ctx2att", a)
    h_att = c_att = context = torch.zeros(feats.shape[0], D)  # init_hidden: zeros; state[0][1] is the context
    out = []
    for t in range(tokens.shape[1]):
        xt = F.relu(state["embed.0.weight"][tokens[:, t]])
        h_att, c_att = lstm_cell(state, torch.cat([xt, mean_feats + context], 1), h_att, c_att)
        att = multi_headed_dot_attention(state, "core.attention", h_att, p_att_feats.narrow(2, 0, D),
                                         p_att_feats.narrow(2, D, D), project_k_v=0, norm_q="core.attention.norm")
        context = F.glu(linear(state, "core.att2ctx.0", torch.cat([att, h_att], 1)), -1)
        out.append(F.log_softmax(linear(state, "logit", context), -1))
    return torch.stack(out, 1)


@pytest.fixture
def authors_files(tmp_path):
    torch.save(authors_state(), tmp_path / "model-best.pth")
    infos = {"opt": argparse.Namespace(num_heads=HEADS, rnn_size=D, input_encoding_size=E, drop_prob_lm=0.5,
                                       caption_model="aoa", refine=1, use_multi_head=2, label_smoothing=0.2),
             "vocab": {str(i + 1): w for i, w in enumerate(WORDS)}, "epoch": 25, "best_val_score": np.float64(1.2),
             "split_ix": {"train": np.arange(4)}}
    with open(tmp_path / "infos_aoanet-best.pkl", "wb") as handle:
        pickle.dump(infos, handle, protocol=2)
    return tmp_path / "model-best.pth", tmp_path / "infos_aoanet-best.pkl"


def our_logprobs(model, vocab, feats, their_tokens, mask=None):
    """The converted model's log-probabilities, step by step, for the authors' token ids (0 = start)."""
    ours = torch.tensor([[vocab.bos_id if t == 0 else vocab.stoi.get(WORDS[t - 1], vocab.unk_id) for t in row]
                         for row in their_tokens.tolist()])
    vis = VisualBatch.from_features(feats) if mask is None else VisualBatch(feats, mask)
    with torch.no_grad():
        enc = model.encode(vis)
        state, out = model.init_state(enc), []
        for t in range(ours.shape[1]):
            logprobs, state, _ = model.step(ours[:, t], state, enc)
            out.append(logprobs)
    return torch.stack(out, 1)


def assert_same_distribution(mine, theirs, vocab):
    # column of each authors' index in our vocabulary: 0 → <eos>, UNK → <unk>, words → their ids
    columns = [vocab.eos_id] + [vocab.unk_id if w == "UNK" else vocab.stoi[w] for w in WORDS]
    torch.testing.assert_close(mine[..., columns], theirs, rtol=0, atol=2e-5)
    assert (mine[..., [vocab.pad_id, vocab.bos_id]] < -1e8).all(), "tokens they cannot emit keep no mass"


def test_converted_model_equals_the_authors_forward(authors_files):
    model, vocab, meta = convert_aoanet(*authors_files)
    feats = torch.randn(3, 5, FEAT)
    tokens = torch.tensor([[0, 1, 2, 4, 5, 3], [0, 6, 6, 1, 2, 4], [0, 3, 1, 1, 5, 2]])
    with torch.no_grad():
        theirs = authors_logprobs(authors_state(), feats, tokens)
    assert_same_distribution(our_logprobs(model, vocab, feats, tokens), theirs, vocab)
    assert meta["source_options"]["num_heads"] == HEADS and "<unk>" in vocab.stoi and "UNK" not in vocab.stoi


def test_the_authors_dropout_and_where_the_weights_came_from_are_kept(authors_files, tmp_path):
    """Fine-tuning an imported checkpoint trains with the authors' ``--drop_prob_lm`` (not this model's default 0.5),
    and ``GET /models`` names their repository as where the weights came from (``meta["imported_from"]``)."""
    infos = pickle.loads(authors_files[1].read_bytes())
    infos["opt"].drop_prob_lm = 0.2
    (tmp_path / "infos_dropout.pkl").write_bytes(pickle.dumps(infos, protocol=2))
    model, _, meta = convert_aoanet(authors_files[0], tmp_path / "infos_dropout.pkl")
    assert model.config()["dropout"] == 0.2 and model.drop.p == 0.2
    source = {"code": "github.com/husthuaan/AoANet", "weights": "model-best.pth", "infos": "infos_dropout.pkl"}
    assert meta["imported_from"] == source


def test_a_checkpoint_trained_without_the_refiner_converts_and_is_recorded_as_having_none(authors_files, tmp_path):
    """``--refine 0``: their ``AoAModel`` replaces the refiner by ``lambda x, y: x``, so the weights hold no
    ``refiner.*`` key. The import equals their forward pass, and the checkpoint's config says ``refiner: none``
    (the Table 4 ablation it is), not an AoA refiner of no layers."""
    state = {key: value for key, value in authors_state().items() if not key.startswith("refiner.")}
    torch.save(state, tmp_path / "unrefined.pth")
    model, vocab, _ = convert_aoanet(tmp_path / "unrefined.pth", authors_files[1])
    assert (model.config()["refine_layers"], model.config()["refiner"]) == (0, "none")
    feats, tokens = torch.randn(2, 4, FEAT), torch.tensor([[0, 2, 4, 6], [0, 1, 1, 5]])
    with torch.no_grad():
        theirs = authors_logprobs(state, feats, tokens)
    assert_same_distribution(our_logprobs(model, vocab, feats, tokens), theirs, vocab)


def test_options_kept_as_a_plain_dict_are_read_and_unlisted_heads_are_the_authors_default(authors_files, tmp_path):
    """An infos file whose ``opt`` was saved as a dict (``vars(opt)``) rather than an ``argparse.Namespace`` still
    gives the model its dropout and heads; an ``opt`` that does not list ``num_heads`` was trained with the
    default of the authors' ``opts.py``, 8 heads (any other count would split the attention differently), and one
    that lists no ``drop_prob_lm`` their default dropout of 0.5 (a fine-tune then trains as they did)."""
    infos = pickle.loads(authors_files[1].read_bytes())
    options = {**vars(infos["opt"]), "drop_prob_lm": 0.2}
    cases = (("dict", options, HEADS, 0.2), ("unlisted", {"drop_prob_lm": 0.2}, 8, 0.2), ("empty", {}, 8, 0.5))
    for name, opt, heads, dropout in cases:
        (tmp_path / f"infos_{name}.pkl").write_bytes(pickle.dumps({**infos, "opt": opt}, protocol=2))
        model, _, meta = convert_aoanet(authors_files[0], tmp_path / f"infos_{name}.pkl")
        assert (model.config()["heads"], model.config()["dropout"]) == (heads, dropout)
        assert meta["source_options"] == opt


def test_import_command_writes_a_loadable_checkpoint(authors_files, tmp_path):
    out = tmp_path / "imported"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "captioner.service.cli", "import", "aoanet", "--weights",
                          str(authors_files[0]), "--infos", str(authors_files[1]), "--out", str(out)],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    ckpt = load_checkpoint(out)
    assert ckpt.model.config()["layer_norm"] == "std" and (out / "model.safetensors").exists()
    feats, tokens = torch.randn(2, 4, FEAT), torch.tensor([[0, 2, 4, 6], [0, 1, 1, 5]])
    with torch.no_grad():
        theirs = authors_logprobs(authors_state(), feats, tokens)
    assert_same_distribution(our_logprobs(ckpt.model, ckpt.vocab, feats, tokens), theirs, ckpt.vocab)


class Exploit:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_infos_pickle_is_allow_listed(tmp_path, authors_files):
    evil = tmp_path / "infos_evil.pkl"
    evil.write_bytes(pickle.dumps({"opt": argparse.Namespace(), "vocab": {"1": "a"}, "x": Exploit()}))
    with pytest.raises(UnsafePickleError, match="posix.system|os.system"):
        restricted_load(evil)
    with pytest.raises(UnsafePickleError):
        convert_aoanet(authors_files[0], evil)
    infos = restricted_load(authors_files[1])
    assert isinstance(infos["opt"], argparse.Namespace) and infos["best_val_score"] == 1.2


@pytest.mark.parametrize("module,name", [
    ("builtins", "getattr"), ("builtins", "eval"), ("builtins", "exec"), ("builtins", "__import__"),
    ("builtins", "open"), ("__builtin__", "getattr"), ("os", "system"), ("subprocess", "Popen"),
    ("importlib", "import_module"), ("numpy", "load"), ("numpy.testing._private.utils", "runstring"),
    ("_codecs", "decode"), ("copyreg", "__newobj__"), ("torch", "load")])
def test_no_global_that_can_run_code_or_reach_one_is_on_the_allow_list(tmp_path, module, name):
    """A GLOBAL opcode naming a callable that reaches code (``getattr`` walks to any attribute, ``__import__`` to
    any module) is refused before it is called, by its name."""
    evil = tmp_path / "global.pkl"
    evil.write_bytes(f"c{module}\n{name}\n.".encode())
    with pytest.raises(UnsafePickleError, match=f"refusing to load {module}.{name}"):
        restricted_load(evil)


@pytest.mark.parametrize("module,name", [("numpy.evil", "ndarray"), ("builtins2", "set"), ("os", "set"),
                                         ("argparse.sub", "Namespace"), ("numpy", "scalar")])
def test_an_allowed_name_under_another_module_is_refused(tmp_path, module, name):
    """The allow-list holds (module, name) pairs: a look-alike module, or an allowed name under another allowed
    module, is refused by its full name, not resolved to the allowed object."""
    lookalike = tmp_path / "lookalike.pkl"
    lookalike.write_bytes(f"c{module}\n{name}\n.".encode())
    with pytest.raises(UnsafePickleError, match=f"refusing to load {module}.{name}"):
        restricted_load(lookalike)


def test_the_allow_lists_name_only_data_classes_and_tensor_rebuilders():
    """Every global a pickle may call, by name: the refused names above are a sample, so a callable added to an
    allow-list (``setattr`` or ``getattr`` would reach code) shows here and is reviewed. The tutorial's own classes
    are stand-ins that run nothing (:class:`PickledModule`) and are not listed."""
    python2 = {("__builtin__", name) for name in ("set", "frozenset", "object")} | {("copy_reg", "_reconstructor")}
    numpy = {(f"numpy.{core}.multiarray", name) for core in ("core", "_core") for name in ("scalar", "_reconstruct")}
    numpy |= {(f"numpy.{core}.numeric", "_frombuffer") for core in ("core", "_core")}
    assert set(ALLOWED) == python2 | numpy | {
        ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "object"), ("copyreg", "_reconstructor"),
        ("argparse", "Namespace"), ("collections", "OrderedDict"), ("_codecs", "encode"), ("numpy", "dtype"),
        ("numpy", "ndarray")}
    callables = {key for key, value in TutorialUnpickler.allowed.items()
                 if not (isinstance(value, type) and issubclass(value, PickledModule))}
    assert callables == {(module, name) for module in ("builtins", "__builtin__")
                         for name in ("dict", "set", "list", "tuple")} | {
        ("collections", "OrderedDict"), ("collections", "defaultdict"), ("torch", "device"),
        ("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_tensor"),
        ("torch._utils", "_rebuild_parameter"), ("torch.nn.parameter", "Parameter"),
        ("torch.nn.backends.thnn", "_get_thnn_function_backend")}


def test_a_python_2_pickle_of_a_numpy_array_loads(tmp_path):
    """The authors' infos files were written by Python 2, where a NumPy array's bytes are a ``str``: only latin1
    reads it back byte for byte (ASCII fails on any byte over 127, as 1.5's 0xf8). The file is Python 2's
    protocol-2 pickle of ``np.array([1.5, -2.0])``, written opcode by opcode."""
    raw = np.array([1.5, -2.0], dtype="<f8").tobytes()
    (tmp_path / "py2.pkl").write_bytes(
        b"\x80\x02cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\nK\x00\x85U\x01b\x87R(K\x01K\x02\x85"
        b"cnumpy\ndtype\nU\x02f8K\x00K\x01\x87R(K\x03U\x01<NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00tb\x89U\x10"
        + raw + b"tb.")
    assert np.array_equal(restricted_load(tmp_path / "py2.pkl"), [1.5, -2.0])


def test_a_python_2_infos_file_reads_its_text_as_str(tmp_path):
    """Python 2 writes its ``str`` keys and words as byte strings (``U``): latin1 reads them as ``str``, so
    ``infos["opt"]`` and the vocabulary's words are found (``encoding="bytes"`` reads arrays too but keys as bytes).
    The file is Python 2's protocol-2 pickle of ``{"opt": 1, "vocab": {"1": "dog"}}``, written opcode by opcode."""
    (tmp_path / "py2.pkl").write_bytes(b"\x80\x02}(U\x03optK\x01U\x05vocab}U\x011U\x03dogsu.")
    assert restricted_load(tmp_path / "py2.pkl") == {"opt": 1, "vocab": {"1": "dog"}}


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_infos_data_pickled_with_any_protocol_loads(tmp_path, protocol):
    """Protocol 5 (``pickle.HIGHEST_PROTOCOL``) spells a contiguous NumPy array as ``numpy._core.numeric._frombuffer``
    over its bytes: an infos file re-saved with it is data as much as the authors' protocol-2 one, and was refused
    naming ``_frombuffer``."""
    infos = {"opt": argparse.Namespace(beam_size=3), "scores": np.arange(6.0).reshape(2, 3),
             "fortran": np.asfortranarray(np.ones((2, 3), np.float32)), "best": np.float32(1.5),
             "order": collections.OrderedDict(a=1), "seen": {1, 2}, "frozen": frozenset("ab"), "raw": b"\xff\x00"}
    path = tmp_path / "infos.pkl"
    path.write_bytes(pickle.dumps(infos, protocol=protocol))
    loaded = restricted_load(path)
    assert vars(loaded["opt"]) == {"beam_size": 3} and loaded["order"] == {"a": 1} and loaded["raw"] == b"\xff\x00"
    assert loaded["seen"] == {1, 2} and loaded["frozen"] == frozenset("ab") and loaded["best"] == np.float32(1.5)
    for key in ("scores", "fortran"):
        assert loaded[key].dtype == infos[key].dtype and np.array_equal(loaded[key], infos[key])


def test_a_pickle_cannot_change_the_classes_and_functions_it_may_name(tmp_path):
    """BUILD sets attributes on the object it is given: a pickle naming argparse.Namespace with a state set
    ``argparse.Namespace.polluted`` for the whole process (the security audit), and a function's ``__defaults__``
    could be replaced the same way. Each load gets its own subclasses and wrappers."""
    polluting = tmp_path / "polluting.pkl"
    polluting.write_bytes(b"\x80\x02cargparse\nNamespace\nN}Vpolluted\nVyes\ns\x86b.")
    restricted_load(polluting)
    assert not hasattr(argparse.Namespace, "polluted")
    rebuild = b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\nN}V__doc__\nVchanged\ns\x86b."
    TutorialUnpickler(io.BytesIO(rebuild)).load()
    assert torch._utils._rebuild_tensor_v2.__doc__ != "changed"
    options = tmp_path / "options.pkl"
    options.write_bytes(pickle.dumps(argparse.Namespace(beam_size=3, rnn_size=512), protocol=2))
    loaded = restricted_load(options)
    assert isinstance(loaded, argparse.Namespace) and vars(loaded) == {"beam_size": 3, "rnn_size": 512}
    assert not hasattr(loaded, "polluted")  # nor on the next load's subclass: the copies are not shared


def test_the_containers_of_a_loaded_pickle_are_the_built_in_types_themselves(tmp_path):
    """Only classes written in Python get a load's own subclass (BUILD could change them for the process); ``set``,
    ``frozenset`` and ``OrderedDict`` are written in C and cannot be changed, so an infos file's sets are plain sets,
    shown and compared as any other (a subclass prints as ``set({1, 2})`` and fails ``type(x) is set``)."""
    path = tmp_path / "infos.pkl"
    infos = {"seen": {1, 2}, "frozen": frozenset("ab"), "order": collections.OrderedDict(a=1)}
    path.write_bytes(pickle.dumps(infos, protocol=2))
    loaded = restricted_load(path)
    assert [type(loaded[key]) for key in ("seen", "frozen", "order")] == [set, frozenset, collections.OrderedDict]
    assert repr(loaded["seen"]) == "{1, 2}"


#: pickles that hand an allowed global data it refuses (``set(1)``; a state set on a plain ``object``), each written
#: opcode by opcode, under the error they raise
REFUSED_DATA = {
    "TypeError": b"\x80\x02c__builtin__\nset\nK\x01\x85R.",
    "AttributeError": b"\x80\x02ccopyreg\n_reconstructor\ncbuiltins\nobject\ncbuiltins\nobject\nN\x87R}U\x01aK\x01sb.",
}


@pytest.mark.parametrize("error", REFUSED_DATA)
def test_a_pickle_calling_an_allowed_global_with_data_it_refuses_is_named_as_unreadable(tmp_path, error):
    """A damaged or foreign file can hand an allowed global data it refuses (``set(1)``; a state set on a plain
    ``object``, which has no ``__dict__``): one error naming the file and the reason, as for any pickle this cannot
    read, not a traceback from inside the unpickler."""
    (tmp_path / "infos.pkl").write_bytes(REFUSED_DATA[error])
    with pytest.raises(pickle.UnpicklingError, match=f"infos.pkl is not a readable pickle \\({error}: "):
        restricted_load(tmp_path / "infos.pkl")


def test_the_allow_list_takes_numpys_functions_from_numpy_2s_module_without_a_deprecation_warning():
    """NumPy 2 renamed ``numpy.core`` to ``numpy._core``; the old name warns of its deprecation at each use (and is
    to go): the allowed NumPy functions are the new module's, so importing the importers warns of nothing (a
    ``-W error`` run or a library's own test suite stopped at the import). The module's code is run afresh here, as
    an import would run it, without replacing the classes the other tests hold."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        fresh = runpy.run_path(safe_pickle.__file__)
    assert fresh["ALLOWED"].keys() == ALLOWED.keys()


def test_unsupported_or_foreign_weights_are_refused(tmp_path, authors_files):
    state = authors_state()
    state["refiner.layers.0.feed_forward.w_1.weight"] = torch.zeros(2, 2)
    torch.save(state, tmp_path / "ff.pth")
    with pytest.raises(ConversionError, match="use_ff"):
        convert_aoanet(tmp_path / "ff.pth", authors_files[1])
    state = authors_state()
    state["fc_embed.0.weight"], state["fc_embed.0.bias"] = torch.zeros(D, FEAT), torch.zeros(D)
    torch.save(state, tmp_path / "fc.pth")  # --mean_feats 0: the LSTM reads fc_embed(fc_feats), which we lack
    with pytest.raises(ConversionError, match="mean_feats 0"):
        convert_aoanet(tmp_path / "fc.pth", authors_files[1])
    torch.save({"something": torch.zeros(1)}, tmp_path / "other.pth")
    with pytest.raises(ConversionError, match="not an AoANet"):
        convert_aoanet(tmp_path / "other.pth", authors_files[1])
    # --use_bn: the authors' att_embed.0 is a BatchNorm1d (1-d weight), named as such rather than mis-unpacked
    bn = {"att_embed.0.weight": torch.ones(FEAT), "att_embed.0.bias": torch.zeros(FEAT),
          "att_embed.0.running_mean": torch.zeros(FEAT), "att_embed.0.running_var": torch.ones(FEAT)}
    torch.save({**authors_state(), **bn}, tmp_path / "bn.pth")
    with pytest.raises(ConversionError, match="use_bn"):
        convert_aoanet(tmp_path / "bn.pth", authors_files[1])


def test_other_attention_or_decoder_layouts_are_refused_naming_their_training_flag(tmp_path, authors_files):
    """Layouts the authors' options build and this model cannot express are refused by the option's name: a
    ``ctx2att`` of 4·D rows (``--multi_head_scale 2``; split in halves of D it was a ValueError traceback), no query
    projection (``--use_multi_head 1``) and the ``base`` decoder's ``att2ctx`` (``Linear(2D, D)`` → ReLU)."""
    scaled = {**authors_state(), "ctx2att.weight": torch.zeros(4 * D, D), "ctx2att.bias": torch.zeros(4 * D)}
    single = {k: v for k, v in authors_state().items() if not k.startswith("core.attention.linears.")}
    base = {**authors_state(), "core.att2ctx.0.weight": torch.zeros(D, 2 * D), "core.att2ctx.0.bias": torch.zeros(D)}
    for name, state, flag in (("scaled", scaled, "use_multi_head 2 with --multi_head_scale 1"),
                              ("single", single, "use_multi_head 2 with --multi_head_scale 1"),
                              ("base", base, "decoder_type AoA")):
        torch.save(state, tmp_path / f"{name}.pth")
        with pytest.raises(ConversionError, match=flag):
            convert_aoanet(tmp_path / f"{name}.pth", authors_files[1])


def test_an_infos_file_of_another_vocabulary_is_refused_counting_both(tmp_path, authors_files):
    """The weights' embedding has a row per word + 1 (index 0, the start and end token): infos of another run, whose
    vocabulary is one word short, would map the rows to the wrong words; one a word longer has words without a row,
    refused the same way rather than as an IndexError from the remapping."""
    for name, words in (("short", WORDS[:-1]), ("long", [*WORDS, "zebra"])):
        infos = {"opt": argparse.Namespace(num_heads=HEADS), "vocab": {str(i + 1): w for i, w in enumerate(words)}}
        with open(tmp_path / f"infos_{name}.pkl", "wb") as handle:
            pickle.dump(infos, handle, protocol=2)
        with pytest.raises(ConversionError, match=f"embedding has {len(WORDS) + 1} rows but the vocabulary "
                                                  f"{len(words)} words"):
            convert_aoanet(authors_files[0], tmp_path / f"infos_{name}.pkl")


def test_weights_under_any_one_key_of_a_snapshot_import_and_a_file_of_no_dict_is_named(tmp_path, authors_files):
    """A training snapshot keeps its weights under one key beside its scalars, not always ``state_dict`` or
    ``model`` (``net`` here); a file holding no dict at all (a list, a bare tensor) is a conversion error naming it,
    not an AttributeError."""
    torch.save({"epoch": 3, "net": authors_state()}, tmp_path / "snapshot.pth")
    snapshot, plain = convert_aoanet(tmp_path / "snapshot.pth", authors_files[1])[0], convert_aoanet(*authors_files)[0]
    assert all(torch.equal(a, b) for a, b in zip(snapshot.state_dict().values(), plain.state_dict().values()))
    for name, held in (("list.pth", [torch.zeros(1)]), ("tensor.pth", torch.zeros(1))):
        torch.save(held, tmp_path / name)
        with pytest.raises(ConversionError, match=f"{name} does not hold a state dict of tensors"):
            convert_aoanet(tmp_path / name, authors_files[1])


class MakesAFolder:
    """Pickles as a call of ``os.makedirs``: whether a load ran the file's code shows on disk."""

    def __init__(self, folder):
        self.folder = folder

    def __reduce__(self):
        return os.makedirs, (str(self.folder),)


def test_weights_are_read_as_tensors_and_never_run_as_code(tmp_path, authors_files):
    """A ``.pth`` is a pickle: the authors' weights are loaded with ``weights_only``, so a file naming a callable is
    refused in words and the callable never runs."""
    torch.save({**authors_state(), "extra": MakesAFolder(tmp_path / "ran")}, tmp_path / "evil.pth")
    with pytest.raises(ConversionError, match="holds pickled Python objects, not only tensors, and is not loaded as "
                                              "code"):
        convert_aoanet(tmp_path / "evil.pth", authors_files[1])
    assert not (tmp_path / "ran").exists()


def test_infos_that_are_not_a_readable_pickle_are_named(tmp_path, authors_files):
    """A JSON, a zip-format .pth, an empty file or an infos whose vocab is a list: one error naming the file."""
    files = {"infos.json": b'["a", "b"]', "empty.pkl": b"", "model.pkl": (authors_files[0]).read_bytes()}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(pickle.UnpicklingError, match=f"{name} is not a readable pickle"):
            convert_aoanet(authors_files[0], tmp_path / name)
    (tmp_path / "list.pkl").write_bytes(pickle.dumps({"opt": {}, "vocab": ["a", "b"]}))
    with pytest.raises(ConversionError, match="no 'vocab' dict"):
        convert_aoanet(authors_files[0], tmp_path / "list.pkl")
    # a vocabulary that skips a number or holds something that is no word, and an array whose pickled shape asks for
    # terabytes: an IndexError or MemoryError traceback, or, for the words, an import that went through (the ONNX
    # and importers audit)
    infos = pickle.loads(authors_files[1].read_bytes())
    last = str(len(infos["vocab"]))
    skipping = {(str(len(WORDS) + 1) if ix == last else ix): word for ix, word in infos["vocab"].items()}
    for vocab, said in ((skipping, "not numbered 1.."), ({**infos["vocab"], "1": "two words"}, "is not a word"),
                        ({**infos["vocab"], "1": ""}, "is not a word"),
                        ({**infos["vocab"], last: infos["vocab"]["1"]}, f"holds {infos['vocab']['1']!r} twice")):
        (tmp_path / "bad.pkl").write_bytes(pickle.dumps({**infos, "vocab": vocab}, protocol=2))
        with pytest.raises(ConversionError, match=said):
            convert_aoanet(authors_files[0], tmp_path / "bad.pkl")
    (tmp_path / "huge.pkl").write_bytes(pickle.dumps(HugeArray(), protocol=2))
    with pytest.raises(pickle.UnpicklingError, match="huge.pkl is not a readable pickle"):
        convert_aoanet(authors_files[0], tmp_path / "huge.pkl")


class HugeArray:
    """Pickles as NumPy's own reconstruction of a 4 EiB array (a few bytes in the file): beyond any address space,
    so no allocator setting lets it through."""

    def __reduce__(self):
        return np.ndarray.__reduce__(np.zeros(1, np.int8))[0], (np.ndarray, (2 ** 62,), b"b")


def test_import_never_replaces_what_it_was_not_asked_to(authors_files, tmp_path, capsys):
    """--out naming an existing folder: refused before the conversion unless --force, and --force replaces only a
    checkpoint, never a folder of anything else."""
    args = ["import", "aoanet", "--weights", str(authors_files[0]), "--infos", str(authors_files[1])]
    precious = tmp_path / "precious"
    (precious / "sub").mkdir(parents=True)
    (precious / "notes.txt").write_text("mine")
    for extra in ([], ["--force"]):
        with pytest.raises(SystemExit) as exc:
            captioner_main([*args, "--out", str(precious), *extra])
        assert exc.value.code == 2 and "precious" in capsys.readouterr().err
        assert (precious / "notes.txt").read_text() == "mine" and (precious / "sub").is_dir()
    captioner_main([*args, "--out", str(tmp_path / "ckpt")])
    with pytest.raises(SystemExit):
        captioner_main([*args, "--out", str(tmp_path / "ckpt")])
    assert "pass --force" in capsys.readouterr().err
    captioner_main([*args, "--out", str(tmp_path / "ckpt"), "--force"])
    assert load_checkpoint(tmp_path / "ckpt").model.arch == "aoanet"


def test_compatibility_flags_default_to_the_paper_and_change_the_model_only_when_set():
    plain = create("aoanet", vocab_size=9, feat_dim=FEAT, d_model=D, embed_dim=E, heads=HEADS, refine_layers=1)
    assert not {"query_norm", "word_embedding", "aoa_query", "projection_bias", "layer_norm"} & set(plain.config())
    assert plain.logit.bias is None and isinstance(plain.query_norm, torch.nn.Identity)
    xlan = create("xlan", vocab_size=9, feat_dim=FEAT, dim=D, hidden_dim=D, embed_dim=E, channel_dim=8, heads=HEADS,
                  encoder_layers=1)
    assert xlan.block_projection is None and "block_projection" not in xlan.config()
    projected = create("xlan", vocab_size=9, feat_dim=FEAT, dim=D, hidden_dim=D, embed_dim=E, channel_dim=8,
                       heads=HEADS, encoder_layers=1, block_projection=True).eval()
    vis = VisualBatch.from_features(torch.randn(2, 3, FEAT))
    with torch.no_grad():
        enc = projected.encode(vis)
        logprobs, _, _ = projected.step(torch.tensor([1, 1]), projected.init_state(enc), enc)
        # the block output goes through LN(W [h; v̂]) before the GLU: recompute c_t by hand from the pieces
        state = projected.init_state(enc)
        words = projected.embed_words(torch.tensor([1, 1]))
        h, _ = projected.lstm(torch.cat([words, enc["global"], state["context"]], 1), (state["h"], state["m"]))
        block = projected.attention.attend(h, enc["keys"], enc["values"], enc["mask"]).attended
        v = F.layer_norm(torch.cat([h, block], 1) @ projected.block_projection[0].weight.T
                         + projected.block_projection[0].bias, (D,), projected.block_projection[1].weight,
                         projected.block_projection[1].bias)
        context = F.glu(torch.cat([v, h], 1) @ projected.context_gate.weight.T + projected.context_gate.bias, -1)
        expected = F.log_softmax(projected.logit(context), -1)
    torch.testing.assert_close(logprobs, expected)


def test_a_refusal_names_up_to_six_keys_and_counts_the_rest():
    # exactly six are all named (no "and 0 more"); a seventh is counted, not named
    six = {f"ours.{index}": f"theirs.{index}" for index in range(6)}
    with pytest.raises(ConversionError) as refused:
        copy_weights({}, six, what="an AoANet")
    assert str(refused.value).endswith("6 expected weight(s): " + ", ".join(sorted(six.values())))
    seven = {**six, "ours.6": "theirs.6"}
    with pytest.raises(ConversionError) as refused:
        copy_weights({}, seven, what="an AoANet")
    assert str(refused.value).endswith(", theirs.5 and 1 more") and "theirs.6" not in str(refused.value)


def test_weights_that_do_not_fit_the_model_are_refused_counting_every_problem():
    """Loading is strict: a mapped state that leaves a parameter out is refused, not loaded around it (its random
    initial values would stay). Each of PyTorch's problem lines is counted and the first three are named."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 2))
    fitting = {key: torch.zeros_like(value) for key, value in model.state_dict().items()}
    with pytest.raises(ConversionError, match=r"\(1 problem\(s\)\): Missing key\(s\) in state_dict: \"1.bias\""):
        load_converted(model, {key: value for key, value in fitting.items() if key != "1.bias"})
    with pytest.raises(ConversionError) as refused:
        load_converted(model, {key: torch.zeros(1) for key in fitting})
    message = str(refused.value)
    assert "(4 problem(s))" in message and message.endswith(" and 1 more")
    assert all(f"size mismatch for {key}:" in message for key in ("0.weight", "0.bias", "1.weight"))
    assert "1.bias" not in message
    load_converted(model, fitting)
    assert not model.training


def test_a_snapshots_weights_are_taken_from_its_known_key_and_never_guessed(tmp_path, authors_files):
    """A snapshot holding its weights under ``model`` beside another dict of tensors (an EMA copy) imports the
    ``model`` ones; two such dicts under no known key are refused rather than one of them taken, and so is a file
    holding an empty dict."""
    torch.save(authors_state(), tmp_path / "plain.pth")
    torch.save({"epoch": 3, "ema": authors_state(seed=1), "model": authors_state()}, tmp_path / "ema.pth")
    plain, with_ema = load_torch_weights(tmp_path / "plain.pth"), load_torch_weights(tmp_path / "ema.pth")
    assert plain.keys() == with_ema.keys() and all(torch.equal(plain[key], with_ema[key]) for key in plain)
    torch.save({"ema": authors_state(seed=1), "net": authors_state()}, tmp_path / "two.pth")
    torch.save({}, tmp_path / "empty.pth")
    for name in ("two.pth", "empty.pth"):
        with pytest.raises(ConversionError, match=f"{name} does not hold a state dict of tensors"):
            convert_aoanet(tmp_path / name, authors_files[1])


@pytest.mark.parametrize("key", ["state_dict", "model_state_dict"])
def test_a_snapshot_keeping_its_weights_under_another_known_key_beside_an_ema_imports_those(tmp_path, key):
    """Training scripts save the weights as ``state_dict`` or ``model_state_dict`` as often as ``model``: beside an
    EMA copy (another dict of tensors) those are the weights imported, not a snapshot refused as ambiguous."""
    torch.save({"epoch": 3, "ema": authors_state(seed=1), key: authors_state()}, tmp_path / "snapshot.pth")
    weights, expected = load_torch_weights(tmp_path / "snapshot.pth"), authors_state()
    assert weights.keys() == expected.keys() and all(torch.equal(weights[name], expected[name]) for name in expected)


def test_a_weights_file_the_user_may_not_read_is_the_os_error_not_a_truncated_file(tmp_path, monkeypatch):
    """A ``.pth`` without read permission (another user's download) is the OS's PermissionError, which the CLI
    reports as such, rather than a file said to be truncated or not a state dict. Simulated: the tests run as root,
    whom no permission stops."""

    def refuse(path, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(torch, "load", refuse)
    with pytest.raises(PermissionError, match="Permission denied"):
        load_torch_weights(tmp_path / "theirs.pth")


@pytest.mark.parametrize("text", ["a\ndog\nUNK\n", "hello world\n", "M"])
def test_a_text_file_given_as_the_weights_is_refused_as_no_state_dict(tmp_path, text):
    """``--checkpoint`` and ``--vocab`` swapped (X-LAN's vocabulary is a text file) is a one-line refusal naming
    the file, not a traceback from inside PyTorch's unpickler."""
    (tmp_path / "coco_vocabulary.txt").write_text(text)
    with pytest.raises(ConversionError, match="coco_vocabulary.txt cannot be read as a PyTorch state dict .*: its "
                                              "bytes are not a pickle"):
        load_torch_weights(tmp_path / "coco_vocabulary.txt")


def test_a_missing_or_truncated_weights_file_is_named_as_what_it_is(tmp_path, authors_files):
    """A path that is not there, or a folder (the run's folder given for its .pth), is the OS's error (the CLI
    reports it as such), not a traceback from further on nor a file said to be truncated; a truncated download
    keeps the reader's reason and is not said to hold pickled Python objects."""
    with pytest.raises(FileNotFoundError):
        convert_aoanet(tmp_path / "missing.pth", authors_files[1])
    with pytest.raises(IsADirectoryError):
        convert_aoanet(tmp_path, authors_files[1])
    truncated = tmp_path / "truncated.pth"
    truncated.write_bytes(authors_files[0].read_bytes()[:1000])
    with pytest.raises(ConversionError, match="cannot be read as a PyTorch state dict") as refused:
        convert_aoanet(truncated, authors_files[1])
    assert "pickled Python objects" not in str(refused.value)
