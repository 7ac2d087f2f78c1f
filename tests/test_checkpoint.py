import copy
import errno
import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from safetensors.torch import save as save_tensors

import captioner.models.checkpoint as checkpoint
from captioner.models import checkpoint as module
from captioner.models import files
from captioner.models.attention import NORMALISERS
from captioner.models.checkpoint import CARD, WEIGHTS, Checkpoint, CheckpointError, checkpoint_name, \
    convert_storage, described_model, find_checkpoints, load_checkpoint, manifest_changes, model_files, on_meta, \
    recorded_checksum, replace_files, save_checkpoint, update_meta, verify_manifest
from captioner.models.decoding import beam_search
from captioner.models.encoder import EncoderSpec
from captioner.models.files import file_checksum, temporary_target
from captioner.models.protocol import AttnRecord, Geometry, VisualBatch, check_step_contract
from captioner.models.registry import MODELS
from captioner.models.sat import ShowAttendTell
from captioner.models.vocab import SPECIALS, Vocabulary, tokenize
from captioner.models.zoo import available, create
from captioner.service.cli import main

from .serving_helpers import tiny_model


@pytest.fixture
def vocab():
    return Vocabulary([f"w{i}" for i in range(19)])


def test_round_trip_gives_identical_captions(tmp_path, tiny_sat, random_visuals, vocab):
    path = save_checkpoint(tmp_path / "ckpt", tiny_sat, vocab, EncoderSpec(), {"note": "test"})
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "manifest.json", "model.safetensors", "vocab.json"]
    loaded = load_checkpoint(path)
    assert loaded.meta == {"note": "test"} and loaded.vocab.itos == vocab.itos
    # the weights' sha256, verified or (without the manifest's check) computed
    assert loaded.checksum == load_checkpoint(path, verify=False).checksum == file_checksum(path / WEIGHTS)
    before = beam_search(tiny_sat, random_visuals, k=3, max_len=8)
    after = beam_search(loaded.model, random_visuals, k=3, max_len=8)
    for a, b in zip(before, after):
        assert a[0].token_ids == b[0].token_ids
        torch.testing.assert_close(a[0].attention, b[0].attention)


def test_overwrite_is_atomic_and_leaves_no_debris(tmp_path, tiny_sat, vocab):
    save_checkpoint(tmp_path / "ckpt", tiny_sat, vocab, EncoderSpec())
    save_checkpoint(tmp_path / "ckpt", tiny_sat, vocab, EncoderSpec(image_size=128))
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]
    assert load_checkpoint(tmp_path / "ckpt").encoder.image_size == 128


def test_a_checkpoint_is_saved_into_an_empty_folder_made_for_it(tmp_path, tiny_sat, vocab):
    """A checkpoint replaces a checkpoint or an empty folder (``mkdir weights/sat`` first): only a folder holding
    something else is refused."""
    (tmp_path / "ckpt").mkdir()
    assert load_checkpoint(save_checkpoint(tmp_path / "ckpt", tiny_sat, vocab, EncoderSpec())).checksum


def test_a_file_where_the_checkpoint_would_go_is_refused_and_kept(tmp_path, tiny_sat, vocab):
    """``--out weights/sat`` naming a file (a typo, an archive of the same name): refused before anything is
    written, and the file is left as it was."""
    (tmp_path / "sat").write_text("not a checkpoint")
    with pytest.raises(FileExistsError, match="sat is a file, not a checkpoint folder: nothing was written there"):
        save_checkpoint(tmp_path / "sat", tiny_sat, vocab, EncoderSpec())
    assert (tmp_path / "sat").read_text() == "not a checkpoint" and [p.name for p in tmp_path.iterdir()] == ["sat"]


def test_a_folder_replaced_while_it_loads_is_loaded_again_not_mixed(tmp_path, tiny_sat, vocab, monkeypatch):
    """A training run replaces best/ whole while a server or eval loads it; each file is opened by name, so a load
    the replacement came through paired the first checkpoint's manifest digest with the second one's weights."""
    path = save_checkpoint(tmp_path / "best", tiny_sat, vocab, EncoderSpec(), {"epoch": 1})
    real_load_file, swaps = module.load_file, []

    def replaced_while_read(file, device="cpu"):
        if not swaps:  # the run saves its next best/ between the manifest check and the weights
            swaps.append(save_checkpoint(tmp_path / "best", tiny_sat, vocab, EncoderSpec(), {"epoch": 2}))
            for value in tiny_sat.state_dict().values():  # other weights than the first save's
                value.add_(0.5)
            save_checkpoint(tmp_path / "best", tiny_sat, vocab, EncoderSpec(), {"epoch": 3})
        return real_load_file(file, device=device)

    monkeypatch.setattr(module, "load_file", replaced_while_read)
    loaded = load_checkpoint(path)
    assert loaded.meta == {"epoch": 3}
    assert loaded.checksum == file_checksum(path / "model.safetensors")  # the digest of the weights it holds


def test_a_folder_replaced_at_every_load_is_refused_not_loaded_mixed(tmp_path, tiny_sat, vocab, monkeypatch):
    """A writer that replaces the folder during every attempt (a run saving ``best/`` again and again): after
    ``LOAD_ATTEMPTS`` loads the caller is told so, not handed a model whose weights may be another save's than the
    digest it reports."""
    path = save_checkpoint(tmp_path / "best", tiny_sat, vocab, EncoderSpec(), {"epoch": 0})
    real_load_file, saves = module.load_file, []

    def replaced_while_read(file, device="cpu"):
        saves.append(save_checkpoint(tmp_path / "best", tiny_sat, vocab, EncoderSpec(), {"epoch": len(saves) + 1}))
        return real_load_file(file, device=device)

    monkeypatch.setattr(module, "load_file", replaced_while_read)
    with pytest.raises(CheckpointError, match=f"was replaced {module.LOAD_ATTEMPTS} times while it was being loaded"):
        load_checkpoint(path)
    assert len(saves) == module.LOAD_ATTEMPTS


def test_a_card_added_through_a_link_keeps_the_link_everything_beside_it_and_a_save_in_flight(tmp_path, tiny_sat,
                                                                                                vocab):
    """``replace_files`` (what ``captioner card`` writes through) swapped the link itself for a copied folder, dropped
    a checkpoint's subfolders and dot-files, and removed the temporary folder of a save in flight beside it."""
    real = save_checkpoint(tmp_path / "store" / "sat", tiny_sat, vocab, EncoderSpec())
    (real / "notes").mkdir()
    (real / "notes" / "run.txt").write_text("how it was trained")
    (real / ".gitattributes").write_text("*.safetensors binary")
    in_flight = tmp_path / "store" / ".sat.tmp-12345"  # a training run's save of the same folder, not yet renamed
    in_flight.mkdir()
    link = tmp_path / "served"
    link.symlink_to(real, target_is_directory=True)
    replace_files(link, {CARD: "# sat\n"})
    assert link.is_symlink() and (real / CARD).read_text() == "# sat\n"
    assert (real / "notes" / "run.txt").read_text() == "how it was trained"
    assert (real / ".gitattributes").exists() and in_flight.exists()
    assert sorted(p.name for p in (tmp_path / "store").iterdir()) == [".sat.tmp-12345", "sat"]
    listed = json.loads((real / "manifest.json").read_text())["files"]
    assert CARD in listed and ".gitattributes" not in listed  # a hidden file is not the checkpoint's


def test_a_card_added_to_a_folder_keeps_a_linked_file_a_link(tmp_path, tiny_sat, vocab):
    """A file of the folder that is a symbolic link (an encoder's weights shared between checkpoints) stays a link
    to the same place, neither copied nor dropped, when ``replace_files`` builds the folder again."""
    shared = tmp_path / "shared-cnn.safetensors"
    shared.write_bytes(b"the CNN")
    path = save_checkpoint(tmp_path / "ckpt", tiny_sat, vocab, EncoderSpec())
    (path / "cnn.safetensors").symlink_to(shared)
    replace_files(path, {CARD: "# sat\n"})
    assert (path / "cnn.safetensors").is_symlink() and os.readlink(path / "cnn.safetensors") == str(shared)
    assert load_checkpoint(path).checksum


def test_a_card_added_where_hard_links_are_refused_copies_the_folder_instead(tmp_path, tiny_sat, vocab, monkeypatch):
    """On a file system without hard links (a network share, a folder on another mount) ``replace_files`` copies
    what it would have linked: a file it neither linked nor copied was missing from the new folder, whose manifest
    then no longer listed the weights, and ``captioner card`` left a checkpoint that no longer loads."""
    path = save_checkpoint(tmp_path / "ckpt", tiny_sat, vocab, EncoderSpec())
    (path / "notes").mkdir()
    (path / "notes" / "run.txt").write_text("how it was trained")
    checksum = load_checkpoint(path).checksum

    def refused(source, target):
        raise OSError(errno.EXDEV, "Invalid cross-device link", str(source))

    monkeypatch.setattr(os, "link", refused)
    replace_files(path, {CARD: "# sat\n"})
    assert load_checkpoint(path).checksum == checksum and (path / CARD).read_text() == "# sat\n"
    assert (path / "notes" / "run.txt").read_text() == "how it was trained"
    assert (path / WEIGHTS).stat().st_nlink == 1  # a copy, not a link


def test_a_save_or_a_replacement_refuses_what_would_not_be_an_extra_file(tmp_path, tiny_sat, vocab):
    """Extra files are plain names beside the model's own: a path would be written outside the folder, and one of
    the checkpoint's own names would replace its weights, config or manifest behind the manifest's back."""
    with pytest.raises(ValueError, match="storage must be one of float32, float16, got 'bfloat16'"):
        save_checkpoint(tmp_path / "half", tiny_sat, vocab, EncoderSpec(), storage="bfloat16")
    for name in ("config.json", "../escape.txt", "sub/notes.txt"):
        with pytest.raises(ValueError, match="cannot be an extra file of a checkpoint folder"):
            save_checkpoint(tmp_path / "ckpt", tiny_sat, vocab, EncoderSpec(), files={name: b"x"})
    path = save_checkpoint(tmp_path / "ckpt", tiny_sat, vocab, EncoderSpec())
    for name in ("model.safetensors", "manifest.json", "../escape.txt"):
        with pytest.raises(ValueError, match="cannot be replaced in a checkpoint folder"):
            replace_files(path, {name: "x"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"] and load_checkpoint(path).checksum


def test_bad_checkpoints_fail_clearly(tmp_path, tiny_sat, vocab):
    with pytest.raises(CheckpointError, match="config.json is missing"):
        load_checkpoint(tmp_path)
    path = save_checkpoint(tmp_path / "ckpt", tiny_sat, vocab, EncoderSpec())
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "format": "something-else"}))
    with pytest.raises(CheckpointError, match="config.json does not match its sha256"):
        load_checkpoint(path)  # an edited file no longer matches the manifest written at save
    with pytest.raises(CheckpointError, match="unknown checkpoint format"):
        load_checkpoint(path, verify=False)
    (path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json is not valid JSON"):
        load_checkpoint(path, verify=False)
    for torn in (b'{"format": "attention', b'{"files": "\x80\x81"}'):  # cut off; bytes that are not UTF-8
        (path / "manifest.json").write_bytes(torn)
        with pytest.raises(CheckpointError, match="manifest.json is not valid JSON"):
            load_checkpoint(path)


def test_a_config_no_model_can_be_built_from_is_named_for_what_it_is(tmp_path, tiny_sat, vocab):
    """A size no tensor can have (a negative dimension) is the constructor's own error, not the meta device's rule
    about reading tensor values, which would send the reader to the wrong place."""
    path = save_checkpoint(tmp_path / "ckpt", tiny_sat, vocab, EncoderSpec())
    config = json.loads((path / "config.json").read_text())
    config["model"]["hidden_dim"] = -5
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"the model cannot be built \(.*negative dimension") as refused:
        load_checkpoint(path, verify=False)
    assert "meta device" not in str(refused.value)


@pytest.mark.parametrize("file, damage, message", [
    ("manifest.json", "[1]", "manifest.json: unknown manifest format 'list'"),
    ("manifest.json", "files", "manifest.json: its files are not a manifest's records"),
    ("config.json", "[1]", "unknown checkpoint format 'list'")])
def test_json_of_another_shape_is_a_checkpoint_error(file, damage, message, tmp_path, tiny_sat, vocab):
    """A manifest or config that is JSON but not an object, or a manifest whose records are not (altered): named,
    where they were an AttributeError traceback."""
    path = save_checkpoint(tmp_path / "ckpt", tiny_sat, vocab, EncoderSpec())
    if damage == "files":
        manifest = json.loads((path / file).read_text())
        damage = json.dumps({**manifest, "files": {**manifest["files"], "config.json": 5}})
    (path / file).write_text(damage)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(path, verify=file == "manifest.json")


@pytest.mark.parametrize("text", ['{"itos": ["a"]}', "{not json", "{}", "[1]", '{"itos": 3}', '"\\ud800"'])
def test_a_file_that_is_not_a_vocabulary_is_a_checkpoint_error_naming_it(tmp_path, tiny_sat, vocab, text):
    """Read without the manifest (what `captioner manifest` checks a folder with), a torn vocabulary was a parser's
    message about no file, or a KeyError traceback."""
    path = save_checkpoint(tmp_path / "ckpt", tiny_sat, vocab, EncoderSpec())
    (path / "vocab.json").write_text(text)
    with pytest.raises(CheckpointError, match=f"{path / 'vocab.json'} is not a vocabulary"):
        load_checkpoint(path, verify=False)


def test_unreadable_or_foreign_weights_are_checkpoint_errors(tmp_path, tiny_sat, vocab):
    # they reached the command line as a safetensors or state_dict traceback
    path = save_checkpoint(tmp_path / "ckpt", tiny_sat, vocab, EncoderSpec())
    weights = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(weights[:len(weights) // 2])
    with pytest.raises(CheckpointError, match="cannot be read as safetensors"):
        load_checkpoint(path, verify=False)
    other = save_checkpoint(tmp_path / "other", create("sat", vocab_size=23, feat_dim=8, embed_dim=8,
                                                       hidden_dim=8, attn_dim=8), vocab, EncoderSpec())
    (path / "model.safetensors").write_bytes((other / "model.safetensors").read_bytes())
    with pytest.raises(CheckpointError, match="does not hold the weights of the sat model"):
        load_checkpoint(path, verify=False)


def test_vocabulary_round_trip_and_tokenizer(tmp_path):
    assert tokenize("A Dog, running!  Fast.") == ["a", "dog", "running", "fast"]
    vocab = Vocabulary.build([["a", "b", "a"], ["c", "a", "b"]], min_count=2)
    assert vocab.itos == ["<pad>", "<bos>", "<eos>", "<unk>", "a", "b"]
    assert vocab.encode(["a", "c", "b"], max_len=2) == [4, 3, 2]
    assert vocab.decode([4, 5, 2, 4]) == ["a", "b"]
    # the rows of a caption's attention that its words keep: <pad> skipped, nothing from the first <eos> on
    assert vocab.kept_positions([4, 0, 5, 2, 4]) == [0, 2] and vocab.decode(iter([4, 0, 5, 2, 4])) == ["a", "b"]
    vocab.save(tmp_path / "v.json")
    assert Vocabulary.load(tmp_path / "v.json").itos == vocab.itos


def test_encode_without_max_len_keeps_every_word():
    # the grounding measure's teacher-forced rows encode whole captions this way (phrase_grounding.py)
    vocab = Vocabulary(["a", "b"])
    assert vocab.encode(["a", "b", "a", "c"]) == [4, 5, 4, 3, 2]


def test_vocabulary_keeps_the_most_frequent_words_first_within_max_size():
    captions = [["c", "b", "a", "d"], ["c", "a", "b"], ["c", "<unk>", "e"]]  # c ×3; a, b ×2 (a tie); d, e, <unk> ×1
    # most frequent first, ties alphabetical; a special token met in the data is not a second entry
    assert Vocabulary.build(captions).itos == ["<pad>", "<bos>", "<eos>", "<unk>", "c", "a", "b", "d", "e"]
    # max_size counts the special tokens: 6 entries in all
    assert Vocabulary.build(captions, max_size=6).itos == ["<pad>", "<bos>", "<eos>", "<unk>", "c", "a"]
    assert Vocabulary.build(captions).stoi["<unk>"] == Vocabulary.unk_id


def test_a_max_size_below_the_special_tokens_is_refused():
    # the words' share of it, max_size - 4, cut from the end when negative: max_size=2 kept all but two words
    with pytest.raises(ValueError, match="max_size counts the 4 special tokens: at least 4, got 3"):
        Vocabulary.build([["a", "b", "c", "d", "e"]], max_size=3)
    assert Vocabulary.build([["a", "b"]], max_size=4).itos == list(SPECIALS)


def test_a_max_size_of_zero_is_refused_not_taken_for_no_limit():
    # 0 is a size, not "unset": only None means no limit
    with pytest.raises(ValueError, match="at least 4, got 0"):
        Vocabulary.build([["a", "b"]], max_size=0)


def test_min_count_counts_a_words_occurrences_not_the_captions_holding_it():
    # "kept if it occurs at least min_count times in the training captions": twice in one caption is twice
    assert Vocabulary.build([["a", "dog", "and", "a", "cat"]], min_count=2).itos == [*SPECIALS, "a"]


def test_the_special_ids_name_the_special_tokens_and_a_foreign_vocabulary_is_refused():
    vocab = Vocabulary.build([["a", "b"]])
    # the ids every model and interop mapping is built with are the positions of the special tokens
    assert [vocab.itos[i] for i in (vocab.pad_id, vocab.bos_id, vocab.eos_id, vocab.unk_id)] == list(SPECIALS)
    assert len(vocab) == 6 == len(vocab.itos)
    # a word list without the special tokens first would shift every id: refused, showing what it starts with
    with pytest.raises(ValueError, match=r"must start with .*, got \['a', '<pad>', '<bos>', '<eos>'\]$"):
        Vocabulary.from_json({"itos": ["a", *SPECIALS]})
    # each of the four in its place: a list without <unk> fourth would shift every word's id by one
    with pytest.raises(ValueError, match="must start with"):
        Vocabulary.from_json({"itos": ["<pad>", "<bos>", "<eos>", "a", "<unk>", "b"]})


def test_float16_storage_halves_the_weights_and_loads_into_the_float32_model(tmp_path, tiny_sat, vocab,
                                                                            random_visuals):
    full = save_checkpoint(tmp_path / "full", tiny_sat, vocab, EncoderSpec())
    half = convert_storage(full, "float16", tmp_path / "half")
    assert (half / WEIGHTS).stat().st_size < 0.6 * (full / WEIGHTS).stat().st_size
    loaded = load_checkpoint(half)  # its manifest verifies, and the model is float32 again
    assert loaded.storage == "float16" and next(loaded.model.parameters()).dtype == torch.float32
    for name, value in tiny_sat.state_dict().items():
        assert torch.equal(loaded.model.state_dict()[name], value.half().float()), name
    # the rounding moves log-probs by float16's precision, not more
    want, got = beam_search(tiny_sat, random_visuals, k=3, max_len=8), beam_search(loaded.model, random_visuals, k=3,
                                                                                  max_len=8)
    for w, g in zip(want, got):
        if w[0].token_ids == g[0].token_ids:
            assert abs(w[0].score - g[0].score) < 1e-2
    update_meta(half, decoding={"length_penalty": 0.5, "block_trigrams": False})  # a record change keeps float16
    assert load_checkpoint(half).storage == "float16" and (half / WEIGHTS).stat().st_size == (
        tmp_path / "half" / WEIGHTS).stat().st_size
    assert convert_storage(half, "float32").exists() and load_checkpoint(half).storage == "float32"


def test_float16_storage_rounds_floating_point_weights_only(tmp_path, vocab):
    """A count kept in the state (hard attention's baseline has seen 5,001 batches) is an integer, stored as one:
    float16 holds integers exactly only up to 2,048."""
    model = tiny_model("sat-hard")
    model.baseline_batches.fill_(5001)
    half = save_checkpoint(tmp_path / "half", model, vocab, EncoderSpec(), storage="float16")
    loaded = load_checkpoint(half).model.baseline_batches
    assert loaded.dtype == torch.int64 and loaded.item() == 5001


def test_weights_stored_otherwise_leave_the_model_card_behind(tmp_path, tiny_sat, vocab, capsys):
    """The card names the weights' sha256 and what they measured: ``storage --out`` copied it beside float16
    weights it no longer described; a record change (the same weights) keeps it."""
    full = save_checkpoint(tmp_path / "full", tiny_sat, vocab, EncoderSpec())
    (full / CARD).write_text("# weights sha256 of the float32 ones\n")
    main(["manifest", str(full)])
    main(["storage", str(full), "float16", "--out", str(tmp_path / "half")])
    assert not (tmp_path / "half" / CARD).exists() and "MODEL_CARD.md was left out" in capsys.readouterr().out
    assert load_checkpoint(tmp_path / "half").storage == "float16"
    update_meta(full, note="kept")
    assert (full / CARD).is_file() and load_checkpoint(full).meta["note"] == "kept"
    assert convert_storage(full, "float32", tmp_path / "same").joinpath(CARD).is_file()  # the same weights


def test_manifest_command_checks_every_folder_before_sealing_any(tmp_path, capsys):
    torch.manual_seed(0)
    good = save_checkpoint(tmp_path / "good", create("sat", vocab_size=9, feat_dim=8, embed_dim=8, hidden_dim=8,
                                                     attn_dim=8), Vocabulary(["a", "b", "c", "d", "e"]),
                           EncoderSpec())
    (good / "manifest.json").unlink()
    (tmp_path / "not-a-checkpoint").mkdir()
    with pytest.raises(SystemExit):  # `captioner manifest weights/*` also matched a folder of checkpoints
        main(["manifest", str(good), str(tmp_path / "not-a-checkpoint")])
    assert "no manifest was written" in capsys.readouterr().err and not (good / "manifest.json").exists()
    main(["manifest", str(good)])
    assert load_checkpoint(good).checksum


def test_manifest_command_reseals_an_edited_card_but_not_changed_weights_unless_forced(tmp_path, capsys):
    """Resealing is for a card edited beside the model; the command sealed a checkpoint whose weights a flipped
    byte had changed under their manifest, and the altered weights then loaded as trusted."""
    torch.manual_seed(0)
    folder = save_checkpoint(tmp_path / "ckpt", create("sat", vocab_size=9, feat_dim=8, embed_dim=8, hidden_dim=8,
                                                       attn_dim=8), Vocabulary(["a", "b", "c", "d", "e"]),
                             EncoderSpec())
    (folder / "MODEL_CARD.md").write_text("# A card\n")
    main(["manifest", str(folder)])
    assert "(changed since the last one: MODEL_CARD.md)" in capsys.readouterr().out
    weights = folder / "model.safetensors"
    altered = bytearray(weights.read_bytes())
    altered[-1] ^= 1  # a bit of the last weight
    weights.write_bytes(bytes(altered))
    with pytest.raises(CheckpointError, match="does not match its sha256"):
        load_checkpoint(folder)
    sealed = (folder / "manifest.json").read_text()
    with pytest.raises(SystemExit):
        main(["manifest", str(folder)])
    assert f"{weights} changed since {folder / 'manifest.json'} was written" in capsys.readouterr().err
    assert (folder / "manifest.json").read_text() == sealed
    main(["manifest", str(folder), "--force"])
    assert load_checkpoint(folder).checksum


def test_manifest_command_refuses_a_changed_encoder_weight_file_the_folder_keeps(tmp_path, capsys):
    """An imported CNN's (or fine-tuned stages') weights in the folder make the model as much as its own weights:
    the command resealed them changed without a word."""
    torch.manual_seed(0)
    folder = save_checkpoint(tmp_path / "ckpt", create("sat", vocab_size=9, feat_dim=8, embed_dim=8, hidden_dim=8,
                                                       attn_dim=8), Vocabulary(["a", "b", "c", "d", "e"]),
                             EncoderSpec(weights="cnn.safetensors"), files={"cnn.safetensors": b"the CNN"})
    assert model_files(folder) == {"model.safetensors", "config.json", "vocab.json", "cnn.safetensors"}
    sealed = (folder / "manifest.json").read_text()
    # altered, then gone (the config still names it, and the encoder would look elsewhere)
    for change in (lambda cnn: cnn.write_bytes(b"another CNN"), Path.unlink):
        change(folder / "cnn.safetensors")
        with pytest.raises(SystemExit):
            main(["manifest", str(folder)])
        assert f"{folder / 'cnn.safetensors'} changed since" in capsys.readouterr().err
        assert (folder / "manifest.json").read_text() == sealed
    main(["manifest", str(folder), "--force"])
    assert "cnn.safetensors" not in (folder / "manifest.json").read_text()


def test_manifest_changes_read_the_folder_when_not_given_its_records(tmp_path, tiny_sat, vocab):
    """``captioner manifest`` passes the records it read once; a library caller passes none, and the folder is read
    (it was compared against ``None``, a TypeError)."""
    path = save_checkpoint(tmp_path / "ckpt", tiny_sat, vocab, EncoderSpec())
    assert manifest_changes(path) == []
    (path / CARD).write_text("# sat\n")
    assert manifest_changes(path) == [CARD]
    (path / "manifest.json").unlink()
    assert manifest_changes(path) is None


def test_a_checkpoint_named_by_a_string_is_verified_like_one_named_by_a_path(tmp_path, tiny_sat, vocab):
    """``verify_manifest`` takes a ``str`` as its signature says (a script checking the shipped folders by name):
    loading passes a ``Path``, so a string was only ever a library caller's, and ``str / str`` a ``TypeError``
    rather than the digests or the refusal naming the altered file."""
    path = save_checkpoint(tmp_path / "ckpt", tiny_sat, vocab, EncoderSpec())
    assert verify_manifest(str(path))[WEIGHTS] == recorded_checksum(path) == file_checksum(path / WEIGHTS)
    (path / "vocab.json").write_text("{}")
    with pytest.raises(CheckpointError, match=f"^{re.escape(str(path / 'vocab.json'))} does not match its sha256"):
        verify_manifest(str(path))


def test_force_replaces_a_checkpoint_but_never_a_folder_that_merely_has_a_config_json(tmp_path, capsys):
    """``--force`` (storage, import, ensemble) took any folder holding a ``config.json`` for a checkpoint and deleted
    it whole: a project's folder with its own config.json and a thesis in it."""
    torch.manual_seed(0)
    source = save_checkpoint(tmp_path / "source", create("sat", vocab_size=9, feat_dim=8, embed_dim=8, hidden_dim=8,
                                                         attn_dim=8), Vocabulary(["a", "b", "c", "d", "e"]),
                             EncoderSpec())
    project = tmp_path / "project"
    (project / "src").mkdir(parents=True)
    (project / "config.json").write_text('{"name": "my project"}')
    (project / "thesis.tex").write_text("years of work")
    with pytest.raises(SystemExit):
        main(["storage", str(source), "float16", "--out", str(project), "--force"])
    assert "not a checkpoint folder" in capsys.readouterr().err and (project / "thesis.tex").is_file()
    # a checkpoint folder with a stranger in it is refused too, naming it
    old = save_checkpoint(tmp_path / "old", create("sat", vocab_size=9, feat_dim=8, embed_dim=8, hidden_dim=8,
                                                   attn_dim=8), Vocabulary(["a", "b", "c", "d", "e"]), EncoderSpec())
    (old / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit):
        main(["storage", str(source), "float16", "--out", str(old), "--force"])
    assert "holds files no checkpoint has (notes.txt)" in capsys.readouterr().err and (old / "notes.txt").is_file()
    (old / "notes.txt").unlink()
    (old / "MODEL_CARD.md").write_text("# card")  # a card is a checkpoint's own
    (old / ".MODEL_CARD.md.tmp-1a2b3c4d").write_text("# ca")  # and a card's write killed half-way is debris
    main(["storage", str(source), "float16", "--out", str(old), "--force"])
    assert load_checkpoint(old).storage == "float16"


@pytest.mark.parametrize("strangers, named", [(3, "(a.txt, b.txt, c.txt)"), (4, "(a.txt, b.txt, c.txt, …)")])
def test_a_refused_folder_names_its_first_three_strangers_and_marks_more(tmp_path, tiny_sat, vocab, strangers, named):
    """A folder of a user's files under a checkpoint's name is refused by a line naming a few of them, in order, with
    "…" where there are more: neither a listing of a whole folder nor three names that hide a fourth."""
    old = save_checkpoint(tmp_path / "old", tiny_sat, vocab, EncoderSpec())
    for name in "abcd"[:strangers]:
        (old / f"{name}.txt").write_text("mine")
    with pytest.raises(FileExistsError) as refused:
        module.check_replaceable(old)
    assert f"holds files no checkpoint has {named}: nothing was written there" in str(refused.value)


def test_storage_says_where_it_wrote_which_dtype_and_the_weights_size(tmp_path, tiny_sat, vocab, capsys):
    """``captioner storage`` is run to halve a checkpoint's bytes: its one line names the folder written, the dtype
    and the new weights' size in MiB, the number the user compares with the old one (a silent run said nothing)."""
    source = save_checkpoint(tmp_path / "source", tiny_sat, vocab, EncoderSpec())
    main(["storage", str(source), "float16", "--out", str(tmp_path / "half")])
    size = (tmp_path / "half" / WEIGHTS).stat().st_size / 2**20
    assert capsys.readouterr().out == f"{tmp_path / 'half'}: weights stored as float16, {size:.1f} MiB\n"


def test_storage_never_replaces_another_checkpoint_at_its_out_unless_forced(tmp_path, tiny_sat, vocab, capsys):
    """``captioner storage A float16 --out B`` over a checkpoint B already there: refused, B kept as it was, as for
    every other command that writes a checkpoint (a mistyped --out deleted a trained model); --force replaces it."""
    source = save_checkpoint(tmp_path / "source", tiny_sat, vocab, EncoderSpec())
    other = save_checkpoint(tmp_path / "other", tiny_sat, vocab, EncoderSpec())
    weights = (other / WEIGHTS).read_bytes()
    with pytest.raises(SystemExit) as refused:
        main(["storage", str(source), "float16", "--out", str(other)])
    assert refused.value.code == 2 and f"{other} already exists" in capsys.readouterr().err
    assert (other / WEIGHTS).read_bytes() == weights
    main(["storage", str(source), "float16", "--out", str(other), "--force"])
    assert load_checkpoint(other).storage == "float16"


def test_storage_rewrites_in_place_when_out_names_the_checkpoint_and_import_never_writes_over_one(tmp_path, tiny_sat,
                                                                                                 vocab, capsys):
    """``--out`` naming the checkpoint itself is the in-place rewrite, not a checkpoint to refuse to replace; an
    import's ``--out`` over a checkpoint is refused before the authors' files are read (they need not exist)."""
    source = save_checkpoint(tmp_path / "source", tiny_sat, vocab, EncoderSpec())
    main(["storage", str(source), "float16", "--out", str(source)])
    assert load_checkpoint(source).storage == "float16"
    with pytest.raises(SystemExit):
        main(["import", "xlan", "--checkpoint", str(tmp_path / "none.pth"), "--vocab", str(tmp_path / "none.txt"),
              "--out", str(source)])
    assert f"{source} already exists: choose another --out, or pass --force" in capsys.readouterr().err


def test_a_config_describing_a_far_larger_model_is_refused_before_it_is_built(tmp_path, tiny_sat, vocab,
                                                                              monkeypatch):
    """A served folder's config.json with hidden_dim=12000 beside megabytes of weights made loading allocate 6 GB
    before the weights were compared: the description is built on the meta device and checked against the
    safetensors header first, and the real model is never built."""
    path = save_checkpoint(tmp_path / "ckpt", tiny_sat, vocab, EncoderSpec())
    config = json.loads((path / "config.json").read_text())
    config["model"]["hidden_dim"] = 12000
    (path / "config.json").write_text(json.dumps(config))
    built = []
    real_create = checkpoint.create

    def counting_create(*args, **kwargs):
        built.append(torch.empty(0).device.type)  # the default device this build runs under
        return real_create(*args, **kwargs)

    monkeypatch.setattr(checkpoint, "create", counting_create)
    with pytest.raises(CheckpointError, match=r"does not hold the weights of the sat model .*\[12000.*described"):
        load_checkpoint(path, verify=False)
    assert built == ["meta"]  # only the description: no 12000-wide model was allocated


def test_the_shape_check_costs_a_server_no_memory_of_its_own(tmp_path, tiny_sat, vocab):
    """Built on the meta device, a model's initialisers ran through torch._refs, whose first use imports
    torch._dynamo and sympy: 155 MB more resident in every server, past its 1 GiB aim. They are skipped."""
    path = save_checkpoint(tmp_path / "ckpt", tiny_sat, vocab, EncoderSpec())
    code = ("import sys; from captioner.models.checkpoint import load_checkpoint; "
            f"load_checkpoint({str(path)!r}); print('torch._dynamo' in sys.modules, 'sympy' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False", "False"]


@pytest.mark.parametrize("normaliser", sorted(NORMALISERS))
def test_every_registered_model_keeps_the_protocol_training_checks(normaliser):
    """``captioner train`` runs one step of every model on random features before reading data
    (``check_step_contract``): a model of the project's own that broke a rule it checks could not be trained."""
    for arch in available():
        model = tiny_model(arch, attention=normaliser) if arch == "sparsecap" else tiny_model(arch)
        check_step_contract(model)


@pytest.mark.parametrize("method,broken,message", [
    ("encode", lambda enc: list(enc.values()), "encode's state must be a dict of tensors, got list"),
    ("init_state", lambda state: {**state, "h": state["h"][:1]},
     r"init_state's state 'h' must be a tensor with the \(batch × beam\) rows on dim 0, here 2; got \[1, 32\]"),
    ("init_state", lambda state: {**state, "t": torch.tensor(0)}, r"init_state's state 't' .* here 2; got \[\]"),
    ("step", lambda answer: answer[:2], r"step must return \(log-probs, new state, AttnRecord\)"),
    ("step", lambda answer: (answer[0][:, :-1], *answer[1:]),
     r"step's log-probs must be \[rows, vocab_size\] = \[2, 23\], got \[2, 22\]"),
    # the bare attention row where its AttnRecord belongs: refused by the rule, not an AttributeError on ``primary``
    ("step", lambda answer: (*answer[:2], answer[2].primary),
     r"step's attention must be an AttnRecord \(its primary row and extras\), got Tensor"),
    ("step", lambda answer: (*answer[:2], AttnRecord(answer[2].primary[:, :-1])),
     r"one weight per visual item, \[rows, items\] = \[2, 9\], got \[2, 8\]"),
    # rows that still sum to 1 and leave the padding at 0, with one weight below zero
    ("step", lambda answer: (*answer[:2], AttnRecord(answer[2].primary + torch.tensor([0.5, -0.5] + [0.0] * 7))),
     "must be a distribution over the items"),
    # non-negative rows, zero on the padding, summing to 0.9
    ("step", lambda answer: (*answer[:2], AttnRecord(answer[2].primary * 0.9)),
     "must be a distribution over the items"),
    # rows uniform over all nine items: distributions, but the second image's last two items are its padding
    ("step", lambda answer: (*answer[:2], AttnRecord(torch.full_like(answer[2].primary, 1 / 9))),
     "must put no weight on masked items"),
    # the check pads the second image's last two items: weight on the first of them, none on the last, is refused
    ("step", lambda answer: (*answer[:2], AttnRecord(torch.tensor([[1 / 9] * 9, [1 / 8] * 8 + [0.0]]))),
     "must put no weight on masked items"),
    ("step", lambda answer: (answer[0], {k: v[:1] for k, v in answer[1].items()}, answer[2]), "step's state 'h'"),
    ("reorder", lambda state: {k: v[:1] for k, v in state.items()}, "reorder's state 'h'"),
])
def test_the_protocol_checks_name_each_rule_a_model_breaks(tiny_sat, monkeypatch, method, broken, message):
    """``check_step_contract`` on a tiny SAT with one method broken: each rule is refused in its own words, naming
    the protocol method, the state key and the shapes (the training CLI audit reaches only some of them)."""
    original = getattr(tiny_sat, method)
    monkeypatch.setattr(tiny_sat, method, lambda *args: broken(original(*args)))
    with pytest.raises(ValueError, match=message):
        check_step_contract(tiny_sat)


def test_every_registered_model_held_in_float64_takes_the_float32_features_it_is_given():
    """The grid encoder, the feature stores and the region reader hand over float32 features whatever the model's
    dtype: a model held in float64 (``.double()`` for a gradient check) or float16 casts them to its weights' dtype in
    ``encode`` rather than failing in its first layer (X-LAN's cast could be dropped with every test passing)."""
    cell = torch.arange(9.0)
    boxes = torch.stack([cell % 3, cell // 3, cell % 3 + 1, cell // 3 + 1], 1).numpy() * 8
    feats = torch.randn(2, 9, tiny_model("sat").feat_dim)
    vis = VisualBatch.from_features(feats, [Geometry("grid", (24, 24), (3, 3), boxes)] * 2)
    as_float64 = VisualBatch.from_features(feats.double(), vis.geometry)
    for arch in available():
        model = tiny_model(arch).double()
        with torch.no_grad():
            given, expected = model.encode(vis), model.encode(as_float64)
        assert given.keys() == expected.keys(), arch
        for name, value in given.items():
            torch.testing.assert_close(value, expected[name], msg=f"{arch}: {name}")


def test_every_registered_model_builds_on_the_meta_device():
    """Loading builds each model on the meta device first (the shape check): a constructor that cannot run there
    would make its checkpoints unloadable."""
    for arch in available():
        model = tiny_model(arch)
        described = on_meta(lambda: create(arch, **model.config(), **_ids(model)))
        assert {n: p.shape for n, p in described.state_dict().items()} == \
               {n: p.shape for n, p in model.state_dict().items()}, arch


def test_the_model_a_checkpoint_describes_is_built_on_the_meta_device(tmp_path, tiny_sat, vocab):
    """What the zoo table counts parameters on: the model of the checkpoint's config.json, without memory."""
    described = described_model(save_checkpoint(tmp_path / "ckpt", tiny_sat, vocab, EncoderSpec()))
    assert {n: p.shape for n, p in described.state_dict().items()} == \
           {n: p.shape for n, p in tiny_sat.state_dict().items()}
    assert {p.device.type for p in described.parameters()} == {"meta"}


def test_a_constructor_that_reads_tensor_values_is_refused_with_the_rule(tmp_path, monkeypatch, tiny_sat, vocab):
    class ScaledSat(ShowAttendTell):
        @functools.wraps(ShowAttendTell.__init__)  # the options create() checks are SAT's
        def __init__(self, *args, **options):
            super().__init__(*args, **options)
            self.scale = float(torch.tensor(4.0).sqrt().item())  # a value read from a tensor

    ScaledSat.arch = "scaled-sat"
    monkeypatch.setitem(MODELS, "scaled-sat", ScaledSat)
    model = ScaledSat(**tiny_sat.config(), **_ids(tiny_sat))
    path = save_checkpoint(tmp_path / "ckpt", model, vocab, EncoderSpec())
    with pytest.raises(CheckpointError, match=r"meta device .*must not read tensor values"):
        load_checkpoint(path)


def _ids(model) -> dict[str, int]:
    return {"pad_id": model.pad_id, "bos_id": model.bos_id, "eos_id": model.eos_id}


def test_a_training_runs_checkpoints_are_named_after_the_run(tmp_path, monkeypatch, tiny_sat, vocab):
    """Two runs' best/ were both served, exported and reported as "best" (the second not served at all)."""
    paths = [save_checkpoint(tmp_path / run / kind, tiny_sat, vocab, EncoderSpec())
             for run in ("sat", "aoanet") for kind in ("best", "last")]
    paths.append(save_checkpoint(tmp_path / "weights" / "best", tiny_sat, vocab, EncoderSpec()))
    assert [checkpoint_name(p) for p in paths] == ["sat", "sat-last", "aoanet", "aoanet-last", "weights"]
    assert sorted(find_checkpoints(None, paths[:4])) == ["aoanet", "aoanet-last", "sat", "sat-last"]
    # a run's folder served as a weights folder: its two checkpoints under the run's name
    assert find_checkpoints(tmp_path / "sat", prefixed={"my-": tmp_path / "aoanet"}) == {
        "sat": paths[0], "sat-last": paths[1], "my-aoanet": paths[2], "my-aoanet-last": paths[3]}
    assert load_checkpoint(paths[0]).name == "sat"
    monkeypatch.chdir(tmp_path / "sat")  # a relative path too
    assert checkpoint_name("best") == "sat" and checkpoint_name("last") == "sat-last"
    monkeypatch.chdir(tmp_path / "sat" / "last")
    assert checkpoint_name("../best") == "sat" and checkpoint_name("../../aoanet/best") == "aoanet"
    assert checkpoint_name(tmp_path / "sat" / "best-f16") == "best-f16"  # any other folder: its own name


def test_a_folder_with_a_config_or_weights_alone_is_not_found_as_a_checkpoint(tmp_path, tiny_sat, vocab):
    """A served weights folder may hold other things: another tool's model folder (a ``config.json`` and no
    ``model.safetensors``), or a checkpoint whose copy has not finished. Neither is listed, so neither is served
    or exported under a name that cannot load."""
    sat = save_checkpoint(tmp_path / "weights" / "sat", tiny_sat, vocab, EncoderSpec())
    (tmp_path / "weights" / "bert").mkdir()
    (tmp_path / "weights" / "bert" / "config.json").write_text('{"model_type": "bert"}')
    (tmp_path / "weights" / "copying").mkdir()
    (tmp_path / "weights" / "copying" / WEIGHTS).write_bytes((sat / WEIGHTS).read_bytes())
    assert find_checkpoints(tmp_path / "weights") == {"sat": sat}
    assert find_checkpoints(None, [tmp_path / "weights" / "bert", tmp_path / "weights" / "copying"]) == {}


def test_a_checkpoint_found_twice_under_one_name_is_not_reported_as_replacing_itself(tmp_path, tiny_sat, vocab):
    """``CAPTIONER_WEIGHTS=weights`` and ``CAPTIONER_CHECKPOINTS=weights/sat`` name one folder twice: only another
    folder under the same name is a replacement to report (the service warns that the loser is not served)."""
    sat = save_checkpoint(tmp_path / "weights" / "sat", tiny_sat, vocab, EncoderSpec())
    other = save_checkpoint(tmp_path / "other" / "sat", tiny_sat, vocab, EncoderSpec())
    replaced = []
    found = find_checkpoints(tmp_path / "weights", [tmp_path / "weights" / ".." / "weights" / "sat"],
                             on_replaced=lambda *heard: replaced.append(heard))
    assert list(found) == ["sat"] and replaced == []
    assert find_checkpoints(tmp_path / "weights", [other], on_replaced=lambda *heard: replaced.append(heard)) == {
        "sat": other}
    assert replaced == [("sat", other, sat)]


def test_a_config_that_is_not_utf8_is_a_checkpoint_error_naming_it(tmp_path, tiny_sat, vocab):
    """A config.json of bytes that are not UTF-8 (another tool's binary file, a torn copy) is named like one that
    is not JSON, where it was a UnicodeDecodeError traceback."""
    path = save_checkpoint(tmp_path / "ckpt", tiny_sat, vocab, EncoderSpec())
    (path / "config.json").write_bytes(b'{"format": "\xff\xfe"}')
    with pytest.raises(CheckpointError, match=f"{re.escape(str(path / 'config.json'))} is not valid JSON"):
        load_checkpoint(path, verify=False)


def test_rewriting_a_checkpoints_record_or_storage_keeps_its_extra_files(tmp_path, tiny_sat, vocab):
    path = save_checkpoint(tmp_path / "ckpt", tiny_sat, vocab, EncoderSpec(weights="cnn.safetensors"),
                           files={"cnn.safetensors": b"weights"})
    (path / ".MODEL_CARD.md.tmp-1a2b3c4d").write_text("# ca")  # a card's write killed half-way: not carried over
    update_meta(path, note="rewritten")
    convert_storage(path, "float16", tmp_path / "half")
    for folder in (path, tmp_path / "half"):
        assert (folder / "cnn.safetensors").read_bytes() == b"weights"
        assert "cnn.safetensors" in json.loads((folder / "manifest.json").read_text())["files"]
        assert not list(folder.glob(".*"))
        loaded = load_checkpoint(folder)
        assert loaded.meta["note"] == "rewritten"
        # the encoder's file named by its name in the folder, not by the path of the folder it was written from
        assert json.loads((folder / "config.json").read_text())["encoder"]["weights"] == "cnn.safetensors"
        assert loaded.encoder.weights == str((folder / "cnn.safetensors").resolve())
    # a relative name the folder does not hold is left as it is, to be found where the encoder looks for it
    elsewhere = save_checkpoint(tmp_path / "elsewhere", tiny_sat, vocab, EncoderSpec(weights="cnn.safetensors"))
    assert load_checkpoint(elsewhere).encoder.weights == "cnn.safetensors"


def test_a_copy_made_from_relative_paths_names_its_encoder_file_by_its_name(tmp_path, tiny_sat, vocab, monkeypatch):
    """``captioner storage weights/sat float16 --out weights/sat-half`` is given relative paths, while the encoder's
    file is loaded as an absolute, resolved one: compared with the folder as given, the copy's config.json named the
    original folder's CNN, so the copy broke once the original was moved or deleted."""
    cnn = {"cnn.safetensors": b"weights"}
    save_checkpoint(tmp_path / "ckpt", tiny_sat, vocab, EncoderSpec(weights="cnn.safetensors"), files=cnn)
    monkeypatch.chdir(tmp_path)
    half = convert_storage("ckpt", "float16", "half")
    assert json.loads((half / "config.json").read_text())["encoder"]["weights"] == "cnn.safetensors"
    assert load_checkpoint(half).encoder.weights == str((tmp_path / "half" / "cnn.safetensors").resolve())


def test_manifest_command_never_seals_a_folder_replaced_while_it_read_its_files(tmp_path, tiny_sat, vocab,
                                                                                  monkeypatch):
    """``captioner card`` (or a training run's save) replaces a checkpoint whole; ``captioner manifest`` running at
    the same time read the old folder's files and wrote their digests into the new folder, which then refused to
    load ("MODEL_CARD.md does not match its sha256") although both commands had succeeded."""
    folder = save_checkpoint(tmp_path / "ckpt", tiny_sat, vocab, EncoderSpec())
    (folder / CARD).write_text("# edited by hand\n")
    real_records, cards = module.file_records, []

    def card_written_meanwhile(path):
        records = real_records(path)
        if not cards:  # `captioner card` swaps in its folder between the manifest's reading and its writing
            cards.append(folder)
            replace_files(folder, {CARD: "# written by captioner card\n"})
        return records

    monkeypatch.setattr(module, "file_records", card_written_meanwhile)
    main(["manifest", str(folder)])
    assert cards and (folder / CARD).read_text() == "# written by captioner card\n"
    assert load_checkpoint(folder).checksum  # still loads: sealed with the digests of the files it holds


def test_manifest_command_seals_other_weights_a_save_swapped_in_while_it_read_the_files(tmp_path, tiny_sat, vocab,
                                                                                      monkeypatch):
    """A training run's save replaced the folder with other weights before the manifest was written: they differ
    from the manifest only by this command's own stale write into the new folder, so that folder is sealed as it
    is, not refused as altered (which would ask for --force)."""
    folder = save_checkpoint(tmp_path / "ckpt", tiny_sat, vocab, EncoderSpec())
    retrained = copy.deepcopy(tiny_sat)
    with torch.no_grad():
        next(retrained.parameters()).add_(1.0)
    real_write, saves = module.write_manifest, []

    def saved_meanwhile(path, *records):  # the save lands between the check of the files and the manifest's write
        if not saves:  # once (a save may write a manifest itself)
            saves.append(folder)
            save_checkpoint(folder, retrained, vocab, EncoderSpec())
        return real_write(path, *records)

    monkeypatch.setattr(module, "write_manifest", saved_meanwhile)
    main(["manifest", str(folder)])
    loaded = load_checkpoint(folder)
    assert saves and torch.equal(next(loaded.model.parameters()), next(retrained.parameters()))


def test_a_card_written_while_another_writer_renames_its_temporary_file_is_written(tmp_path, tiny_sat, vocab,
                                                                                  monkeypatch):
    """``captioner manifest`` writes ``.manifest.json.tmp-XXXXXXXX`` and renames it; ``captioner card`` at the same
    time listed it, found it gone when it linked it, and failed with "manifest.json: No such file or directory"."""
    folder = save_checkpoint(tmp_path / "ckpt", tiny_sat, vocab, EncoderSpec())
    in_flight = folder / ".manifest.json.tmp-0a1b2c3d"
    in_flight.write_text((folder / "manifest.json").read_text())
    real_link = module._link_or_copy

    def renamed_meanwhile(source, target):
        in_flight.unlink(missing_ok=True)  # the other writer's rename lands between the listing and the link
        real_link(source, target)

    monkeypatch.setattr(module, "_link_or_copy", renamed_meanwhile)
    replace_files(folder, {CARD: "# sat\n"})
    assert (folder / CARD).read_text() == "# sat\n" and load_checkpoint(folder).checksum
    assert not list(folder.glob(".*"))


@pytest.mark.parametrize("file", ["model.safetensors", "config.json", "vocab.json", "MODEL_CARD.md"])
def test_a_listed_file_altered_in_place_or_gone_is_refused_naming_it(file, tmp_path, tiny_sat, vocab):
    """One byte changed (the size the manifest records unchanged: a flipped bit, an edit of the same length) is
    refused as surely as a torn file, for the model's files and for an extra file the manifest lists; so is a
    listed file that is gone, and a manifest that no longer lists one of the model's files."""
    path = save_checkpoint(tmp_path / "ckpt", tiny_sat, vocab, EncoderSpec())
    replace_files(path, {"MODEL_CARD.md": "# a card\n"})
    assert load_checkpoint(path).checksum  # sealed whole
    original = (path / file).read_bytes()
    middle = len(original) // 2
    (path / file).write_bytes(original[:middle] + bytes([original[middle] ^ 1]) + original[middle + 1:])
    with pytest.raises(CheckpointError, match=re.escape(f"{path / file} does not match its sha256")):
        load_checkpoint(path)
    (path / file).unlink()
    gone = f"{path / file} is listed in manifest.json but missing"
    if file == "config.json":  # no config at all: not a checkpoint, before the manifest is read
        gone = "config.json is missing"
    with pytest.raises(CheckpointError, match=re.escape(gone)):
        load_checkpoint(path)
    (path / file).write_bytes(original)
    manifest = json.loads((path / "manifest.json").read_text())
    del manifest["files"][file]
    (path / "manifest.json").write_text(json.dumps(manifest))
    if file == "MODEL_CARD.md":  # an extra file the manifest does not list is not the model's: it loads
        load_checkpoint(path)
    else:
        with pytest.raises(CheckpointError, match=re.escape(f"manifest.json does not list {file}")):
            load_checkpoint(path)


def test_a_loaded_model_is_in_eval_mode_and_deterministic(tmp_path, random_visuals, vocab):
    """A model saved while training (dropout on) loads ready to caption: every module in eval mode, so the same
    visuals give the same caption and scores every time."""
    torch.manual_seed(0)
    model = create("sat", vocab_size=23, feat_dim=16, embed_dim=24, hidden_dim=32, attn_dim=20, dropout=0.5)
    assert model.train().training
    loaded = load_checkpoint(save_checkpoint(tmp_path / "ckpt", model, vocab, EncoderSpec())).model
    assert not any(module.training for module in loaded.modules())
    first, second = (beam_search(loaded, random_visuals, k=3, max_len=8) for _ in range(2))
    for a, b in zip(first, second):
        assert a[0].token_ids == b[0].token_ids and a[0].score == b[0].score


def test_a_region_checkpoint_refused_for_photos_is_named_by_its_folder(tmp_path, tiny_sat, vocab):
    """The refusal names the folder the user gave (``runs/sat/best``, whose model is named ``sat``), or the model's
    name where the checkpoint was never on disk."""
    regions = {"train_config": {"features": "regions:feats"}}
    on_disk = Checkpoint(tiny_sat, vocab, EncoderSpec(), path=tmp_path / "runs" / "sat" / "best", meta=regions)
    with pytest.raises(CheckpointError, match=f"^{re.escape(str(tmp_path / 'runs' / 'sat' / 'best'))} was trained"):
        on_disk.check_reads_images()
    with pytest.raises(CheckpointError, match="^sat was trained on region features"):
        Checkpoint(tiny_sat, vocab, EncoderSpec(), meta=regions).check_reads_images()


def test_a_save_clears_what_a_crash_of_an_earlier_save_left_beside_it(tmp_path, tiny_sat, vocab):
    """A save killed half-way leaves its temporary folder, and one killed between the two renames of a swap leaves
    the previous checkpoint set aside (``.NAME.old``): the next save of the folder clears both, or each crash would
    keep a whole checkpoint's bytes beside it for good."""
    path = save_checkpoint(tmp_path / "ckpt", tiny_sat, vocab, EncoderSpec())
    (tmp_path / ".ckpt.tmp-0badf00d").mkdir()
    (tmp_path / ".ckpt.tmp-0badf00d" / WEIGHTS).write_bytes(b"half written")
    save_checkpoint(tmp_path / ".ckpt.old", tiny_sat, vocab, EncoderSpec())
    save_checkpoint(path, tiny_sat, vocab, EncoderSpec(image_size=128))
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]
    assert load_checkpoint(path).encoder.image_size == 128


def test_debris_a_save_cannot_remove_does_not_stop_the_save(tmp_path, tiny_sat, vocab):
    """Clearing an earlier crash's debris is a courtesy: what cannot be removed as a folder (here a file under a
    temporary folder's name) is left where it is, and the checkpoint is saved all the same."""
    (tmp_path / ".ckpt.tmp-0badf00d").write_text("not a folder")
    path = save_checkpoint(tmp_path / "ckpt", tiny_sat, vocab, EncoderSpec())
    assert load_checkpoint(path).checksum


def test_a_save_flushes_each_file_and_then_the_folder_before_it_takes_the_checkpoints_place(tmp_path, tiny_sat, vocab,
                                                                                          monkeypatch):
    """Written but not flushed, a file may be empty after a power cut while the rename that put its folder in place
    survived: a checkpoint the manifest then refuses, with the previous one gone."""
    real_fsync_path, flushed = module.fsync_path, []

    def fsync_path(file):
        flushed.append((Path(file).name, (Path(file) / "manifest.json").is_file()))
        real_fsync_path(file)

    monkeypatch.setattr(module, "fsync_path", fsync_path)
    save_checkpoint(tmp_path / "ckpt", tiny_sat, vocab, EncoderSpec())
    assert {("config.json", False), ("vocab.json", False)} <= set(flushed)  # the weights are created durably
    # the temporary folder, once it holds its manifest, before its rename
    assert any(temporary_target(name) == "ckpt" and sealed for name, sealed in flushed)


def test_a_card_added_keeps_a_link_to_a_folder_inside_a_subfolder_a_link(tmp_path, tiny_sat, vocab):
    """``replace_files`` copies subfolders with their links as links, as it does the folder's own files: a link to a
    folder of shared data is not replaced by a copy of that folder."""
    shared = tmp_path / "shared-data"
    shared.mkdir()
    (shared / "rows.txt").write_text("shared")
    path = save_checkpoint(tmp_path / "ckpt", tiny_sat, vocab, EncoderSpec())
    (path / "notes").mkdir()
    (path / "notes" / "data").symlink_to(shared, target_is_directory=True)
    replace_files(path, {CARD: "# sat\n"})
    assert (path / "notes" / "data").is_symlink() and os.readlink(path / "notes" / "data") == str(shared)


def test_a_folder_whose_files_vanish_in_a_replacement_while_it_loads_is_loaded_again(tmp_path, tiny_sat, vocab,
                                                                                       monkeypatch):
    """Between the two renames of a swap (where the OS cannot exchange folders) a file opened by name is not there:
    that ``OSError`` is the replacement's, and the load is made again from the new folder, not refused."""
    path = save_checkpoint(tmp_path / "best", tiny_sat, vocab, EncoderSpec(), {"epoch": 1})
    real_file_checksum, swaps = module.file_checksum, []

    def gone_while_hashed(file):  # the manifest's check found the file, then the swap took it away
        if not swaps:
            swaps.append(file)  # first, as the save below hashes its files through this too
            save_checkpoint(tmp_path / "best", tiny_sat, vocab, EncoderSpec(), {"epoch": 2})
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(file))
        return real_file_checksum(file)

    monkeypatch.setattr(module, "file_checksum", gone_while_hashed)
    assert load_checkpoint(path).meta == {"epoch": 2}


def test_the_recorded_checksum_is_the_manifests_without_hashing_and_none_without_one(tmp_path, tiny_sat, vocab):
    path = save_checkpoint(tmp_path / "ckpt", tiny_sat, vocab, EncoderSpec())
    assert recorded_checksum(path) == load_checkpoint(path).checksum == file_checksum(path / WEIGHTS)
    (path / "manifest.json").unlink()
    assert recorded_checksum(path) is None


@pytest.mark.parametrize("manifest", ["[1]", "null", '"files"'])
def test_a_manifest_of_json_but_no_object_records_no_checksum(manifest, tmp_path, tiny_sat, vocab):
    """The lenient readers answer None for a manifest they cannot read as one: a server's start asks each checkpoint
    it serves through ONNX for its recorded sha256 (is the export current?), and an altered manifest.json of other
    JSON was an AttributeError that stopped the server, where loading names that checkpoint and skips it."""
    path = save_checkpoint(tmp_path / "ckpt", tiny_sat, vocab, EncoderSpec())
    (path / "manifest.json").write_text(manifest)
    assert recorded_checksum(path) is None and manifest_changes(path) is None


def test_a_float32_checkpoints_config_names_no_storage(tmp_path, tiny_sat, vocab):
    """The storage is written only where it is not float32, so a float32 checkpoint's ``config.json`` (and its
    recorded sha256) is the same as before storages existed."""
    path = save_checkpoint(tmp_path / "ckpt", tiny_sat, vocab, EncoderSpec())
    assert "storage" not in json.loads((path / "config.json").read_text())
    assert load_checkpoint(path).storage == "float32"


def test_a_save_that_dies_moving_its_folder_in_leaves_the_previous_checkpoint(tmp_path, tiny_sat, vocab, monkeypatch):
    """The previous checkpoint is swapped out, or (where the OS cannot exchange folders, forced here) set aside and
    put back by the next save or resume: never removed before the new folder is in place, so a save that dies at
    the last rename (a full disk, a kill) still leaves a checkpoint to load."""
    path = save_checkpoint(tmp_path / "ckpt", tiny_sat, vocab, EncoderSpec(), {"epoch": 1})
    real_replace = os.replace

    def dies_moving_in(source, target, **options):
        if Path(target) == path:
            raise OSError(errno.ENOSPC, "No space left on device", str(target))
        real_replace(source, target, **options)

    monkeypatch.setattr(files, "_exchange", lambda a, b: False)
    monkeypatch.setattr(os, "replace", dies_moving_in)
    with pytest.raises(OSError, match="No space left on device"):
        save_checkpoint(path, tiny_sat, vocab, EncoderSpec(), {"epoch": 2})
    monkeypatch.undo()
    module.remove_debris(path)  # what the next save of the folder, or a training run's resume, does first
    assert load_checkpoint(path).meta == {"epoch": 1}


@pytest.mark.parametrize("file, newer", [("config.json", "attention-captioner/2"),
                                         ("manifest.json", "attention-captioner-manifest/2")])
def test_a_checkpoint_of_a_newer_format_is_refused_not_read_as_this_one(file, newer, tmp_path, tiny_sat, vocab):
    """A later version of the format may mean its files otherwise: only this version is read, not any of the same
    name (the config is sealed again, so that the refusal is the format's and not the manifest's digest)."""
    path = save_checkpoint(tmp_path / "ckpt", tiny_sat, vocab, EncoderSpec())
    (path / file).write_text(json.dumps({**json.loads((path / file).read_text()), "format": newer}))
    if file == "config.json":
        module.write_manifest(path)
    kind = "checkpoint" if file == "config.json" else "manifest"
    with pytest.raises(CheckpointError, match=f"unknown {kind} format '{re.escape(newer)}'"):
        load_checkpoint(path)


def test_weights_lacking_a_tensor_holding_another_or_of_another_model_are_refused_naming_them(tmp_path, tiny_sat,
                                                                                               vocab):
    """The shape check compares the tensors' names as well as their shapes: weights without one of the model's
    tensors, with one it has not, or of another architecture reached ``load_state_dict`` and its RuntimeError, not
    a :class:`CheckpointError` naming the folder's weights."""
    path = save_checkpoint(tmp_path / "ckpt", tiny_sat, vocab, EncoderSpec())
    state = load_file(path / WEIGHTS)
    dropped = sorted(state)[0]
    other = save_checkpoint(tmp_path / "aoanet", tiny_model("aoanet"), vocab, EncoderSpec())
    for weights, named in ((save_tensors({k: v for k, v in state.items() if k != dropped}),
                            f"missing {re.escape(dropped)}$"),
                           (save_tensors({**state, "extra.weight": torch.zeros(2)}), "unexpected extra.weight$"),
                           ((other / WEIGHTS).read_bytes(), r"; and \d+ more$")):
        (path / WEIGHTS).write_bytes(weights)
        with pytest.raises(CheckpointError, match=f"does not hold the weights of the sat model its config.json "
                                                  f"describes: .*{named}"):
            load_checkpoint(path, verify=False)


def test_a_shape_check_names_five_problems_and_counts_the_rest(tmp_path, tiny_sat, vocab):
    """Weights far from their config (another model's, say) list five problems and say how many more there are:
    the count is what tells a reader whether the weights are close to the model or another one altogether."""
    path = save_checkpoint(tmp_path / "ckpt", tiny_sat, vocab, EncoderSpec())
    extra = {f"extra{i}.weight": torch.zeros(2) for i in range(7)}
    (path / WEIGHTS).write_bytes(save_tensors({**load_file(path / WEIGHTS), **extra}))
    with pytest.raises(CheckpointError) as refused:
        load_checkpoint(path, verify=False)
    assert str(refused.value).endswith(": " + "; ".join(f"unexpected extra{i}.weight" for i in range(5))
                                       + "; and 2 more")


@pytest.mark.parametrize("stray, counted", [(5, ""), (6, "; and 1 more")])
def test_a_shape_check_counts_a_sixth_problem_and_nothing_when_five_are_all(stray, counted, tmp_path, tiny_sat, vocab):
    """At the boundary of the five shown: a sixth problem is counted ("and 1 more"), so a reader never takes five
    listed problems for all of them, and five are all there is to say."""
    path = save_checkpoint(tmp_path / "ckpt", tiny_sat, vocab, EncoderSpec())
    extra = {f"extra{i}.weight": torch.zeros(2) for i in range(stray)}
    (path / WEIGHTS).write_bytes(save_tensors({**load_file(path / WEIGHTS), **extra}))
    with pytest.raises(CheckpointError) as refused:
        load_checkpoint(path, verify=False)
    assert str(refused.value).endswith(": " + "; ".join(f"unexpected extra{i}.weight" for i in range(5)) + counted)


def test_a_constructor_chaining_an_in_place_fill_keeps_its_tensor_on_the_meta_device():
    """On the meta device the in-place fills are skipped but still return their tensor, as PyTorch's do: a
    constructor that writes ``nn.Parameter(torch.empty(3, 4).uniform_())`` gets a (3, 4) parameter there, not the
    empty one ``nn.Parameter(None)`` makes, which the shape check would then refuse against the stored weights."""
    def build():
        model = torch.nn.Module()
        model.scale = torch.nn.Parameter(torch.empty(3, 4).uniform_(-0.1, 0.1))
        model.register_buffer("offset", torch.zeros(5).fill_(1.0))
        return model

    assert module.state_shapes(on_meta(build)) == {"scale": (3, 4), "offset": (5,)}


def test_a_model_built_with_other_special_ids_loads_with_them(tmp_path, vocab):
    """``config.json`` records the special ids the model was built with and loading passes them to its constructor:
    without them a model built with other ids came back with the defaults, starting and ending its captions at
    other words."""
    model = create("sat", vocab_size=23, feat_dim=16, embed_dim=24, hidden_dim=32, attn_dim=20, pad_id=3, bos_id=4,
                   eos_id=5)
    loaded = load_checkpoint(save_checkpoint(tmp_path / "ckpt", model, vocab, EncoderSpec())).model
    assert (loaded.pad_id, loaded.bos_id, loaded.eos_id) == (3, 4, 5)


def test_a_record_field_written_again_replaces_the_old_value_and_keeps_the_others(tmp_path, tiny_sat, vocab):
    """``captioner tune`` writes a checkpoint's decoding rules with ``update_meta``; tuned again, the new rules are
    the ones kept (the older record must not win), and the rest of the record stays."""
    path = save_checkpoint(tmp_path / "ckpt", tiny_sat, vocab, EncoderSpec(), {"name": "sat"})
    update_meta(path, decoding={"length_penalty": 0.5})
    update_meta(path, decoding={"length_penalty": 1.0})
    assert load_checkpoint(path).meta == {"name": "sat", "decoding": {"length_penalty": 1.0}}


def test_a_training_run_given_for_a_checkpoint_names_each_checkpoint_it_holds(tmp_path, tiny_sat, vocab):
    """``captioner eval runs/sat`` means one of the run's checkpoints: the error offers each it holds, ``last/`` too
    (a run stopped before its first validation has no ``best/``)."""
    run = tmp_path / "sat"
    save_checkpoint(run / "last", tiny_sat, vocab, EncoderSpec())
    with pytest.raises(CheckpointError, match=f"is a training run, not a checkpoint: give {re.escape(str(run))}/last$"):
        load_checkpoint(run)
    save_checkpoint(run / "best", tiny_sat, vocab, EncoderSpec())
    with pytest.raises(CheckpointError, match=re.escape(f"not a checkpoint: give {run / 'best'} or {run / 'last'}")):
        load_checkpoint(run)


def test_a_name_recorded_in_a_checkpoint_is_the_name_it_reports(tmp_path, tiny_sat, vocab):
    """``meta["name"]`` (a library caller's own name for a model) comes before its folder's name in the reports."""
    path = save_checkpoint(tmp_path / "best", tiny_sat, vocab, EncoderSpec(), {"name": "sat-baseline"})
    assert load_checkpoint(path).name == "sat-baseline"


def test_a_replacement_flushes_its_files_and_then_the_folder_before_it_takes_the_checkpoints_place(tmp_path, tiny_sat,
                                                                                                   vocab, monkeypatch):
    """As a save's: a card written but not flushed may be empty after a power cut while the rename that put its
    folder in place survived, and the manifest that lists it then refuses the checkpoint."""
    path = save_checkpoint(tmp_path / "ckpt", tiny_sat, vocab, EncoderSpec())
    real_create_durably, real_fsync_path, flushed = module.create_durably, module.fsync_path, []

    def create_durably(file, data):
        flushed.append((Path(file).name, False))
        real_create_durably(file, data)

    def fsync_path(folder):
        flushed.append((Path(folder).name, CARD in module.listed_files(Path(folder))))
        real_fsync_path(folder)

    monkeypatch.setattr(module, "create_durably", create_durably)
    monkeypatch.setattr(module, "fsync_path", fsync_path)
    replace_files(path, {CARD: "# sat\n"})
    assert (CARD, False) in flushed
    # the temporary folder, once its manifest lists the card, before its rename
    assert any(temporary_target(name) == "ckpt" and sealed for name, sealed in flushed)


def test_a_card_whose_folder_cannot_be_flushed_once_in_place_reports_that_error(tmp_path, tiny_sat, vocab,
                                                                                  monkeypatch):
    """The last step of a replacement flushes the parent folder after the new one took the checkpoint's place, so
    its temporary folder is gone by then: the clean-up after a failure there must not stumble on that and raise a
    FileNotFoundError for a folder the user never named, hiding the disk's own error (and the card is in place)."""
    path = save_checkpoint(tmp_path / "ckpt", tiny_sat, vocab, EncoderSpec())
    real_fsync_path = files.fsync_path

    def parent_cannot_be_flushed(folder):
        if Path(folder) == tmp_path:
            raise OSError(errno.EIO, "Input/output error", str(folder))
        real_fsync_path(folder)

    monkeypatch.setattr(files, "fsync_path", parent_cannot_be_flushed)
    with pytest.raises(OSError, match="Input/output error") as raised:
        replace_files(path, {CARD: "# sat\n"})
    assert raised.value.errno == errno.EIO
    monkeypatch.undo()
    assert (path / CARD).read_text() == "# sat\n" and load_checkpoint(path).checksum


def test_a_rewritten_checkpoint_keeps_an_encoder_file_outside_its_folder_by_its_full_path(tmp_path, tiny_sat, vocab):
    """Only a file inside the folder is named by its name alone when the checkpoint is written again: a CNN's weights
    kept elsewhere (an absolute path) would otherwise be looked for beside the working directory."""
    cnn = tmp_path / "shared" / "cnn.safetensors"
    cnn.parent.mkdir()
    cnn.write_bytes(b"the CNN")
    path = save_checkpoint(tmp_path / "ckpt", tiny_sat, vocab, EncoderSpec(weights=str(cnn)))
    update_meta(path, note="rewritten")
    assert json.loads((path / "config.json").read_text())["encoder"]["weights"] == str(cnn)
    assert load_checkpoint(path).encoder.weights == str(cnn)


@pytest.mark.parametrize("write", ["save", "card"])
def test_a_write_cut_by_ctrl_c_leaves_no_folder_beside_its_checkpoint(write, tmp_path, tiny_sat, vocab, monkeypatch):
    """Ctrl-C (a KeyboardInterrupt, no Exception) in a training run's save or in ``captioner card`` clears the
    temporary folder as a full disk does: left, it kept a whole checkpoint's bytes beside the folder (a card's is
    cleared by no later card, only by a later save), and the previous checkpoint stands."""
    path = save_checkpoint(tmp_path / "ckpt", tiny_sat, vocab, EncoderSpec(), {"epoch": 1})

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(module, "write_manifest", interrupted)  # the weights are written by then: a folder to leave
    with pytest.raises(KeyboardInterrupt):
        if write == "save":
            save_checkpoint(path, tiny_sat, vocab, EncoderSpec(), {"epoch": 2})
        else:
            replace_files(path, {CARD: "# sat\n"})
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]
    assert load_checkpoint(path).meta == {"epoch": 1} and not (path / CARD).exists()
