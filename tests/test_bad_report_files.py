"""A report, notes file or document a page is written from that is not UTF-8, or whose markers are out of order: one
line naming the file and exit status 2 (they were the codec's message alone, or an IndexError traceback)."""

from __future__ import annotations

import json
import shutil

import pytest


from .conftest import ROOT, cli_error

REPORT = ROOT / "docs" / "results" / "sat.json"


@pytest.mark.parametrize("which", ["report", "notes"])
def test_a_card_from_a_file_that_is_not_utf8_names_it(which, tmp_path, capsys):
    checkpoint = shutil.copytree(ROOT / "weights" / "sat", tmp_path / "sat")
    bad = tmp_path / f"bad.{'json' if which == 'report' else 'md'}"
    bad.write_bytes(b'\xff\xfe{"test": {}}')
    options = ["--report", str(bad)] if which == "report" else ["--report", str(REPORT), "--notes", str(bad)]
    message = cli_error(capsys, "card", str(checkpoint), *options)
    assert message == f"error: {bad}:1 is not UTF-8 text (byte 0: invalid start byte)"


def test_a_document_with_its_markers_in_the_wrong_order_is_named_and_left_alone(tmp_path, capsys):
    document = tmp_path / "zoo.md"
    text = "intro\n<!-- zoo-f8k:end -->\nmiddle\n<!-- zoo-f8k:start -->\nold\n"
    document.write_text(text)
    (tmp_path / "weights").mkdir()
    (tmp_path / "results").mkdir()
    message = cli_error(capsys, "zoo-f8k", "--weights-dir", str(tmp_path / "weights"), "--results",
                        str(tmp_path / "results"), "--document", str(document))
    assert message.startswith(f"error: {document}: <!-- zoo-f8k:end --> comes before")
    assert document.read_text() == text


@pytest.mark.parametrize("kept", ["start", "end"])
def test_a_document_with_one_of_its_markers_is_named_and_left_alone(kept, tmp_path, capsys):
    """Appending a second table to it would leave two starts (or ends): the next run would then replace the prose
    between the two tables with the generated text."""
    document = tmp_path / "zoo.md"
    text = f"intro\n<!-- zoo-f8k:{kept} -->\nold\n\n## Prose\n\nkept\n"
    document.write_text(text)
    (tmp_path / "weights").mkdir()
    (tmp_path / "results").mkdir()
    message = cli_error(capsys, "zoo-f8k", "--weights-dir", str(tmp_path / "weights"), "--results",
                        str(tmp_path / "results"), "--document", str(document))
    missing = "end" if kept == "start" else "start"
    assert message.startswith(f"error: {document}: <!-- zoo-f8k:{kept} --> without <!-- zoo-f8k:{missing} -->")
    assert document.read_text() == text


def test_a_document_that_is_not_utf8_is_named(tmp_path, capsys):
    document = tmp_path / "zoo.md"
    document.write_bytes(b"intro \xff\n")
    (tmp_path / "weights").mkdir()
    (tmp_path / "results").mkdir()
    message = cli_error(capsys, "zoo-f8k", "--weights-dir", str(tmp_path / "weights"), "--results",
                        str(tmp_path / "results"), "--document", str(document))
    assert message == f"error: {document}:1 is not UTF-8 text (byte 6: invalid start byte)"


@pytest.mark.parametrize("change", [{"decoding": [1]}, {"decoding": {"beam": 3}}, {"decoding": {"length_penalty": "1"}},
                                    {"decoding": {"length_penalty": 9}}, {"test": {"CIDEr-D": [1]}}])
def test_a_card_from_a_report_of_the_wrong_shape_names_it(change, tmp_path, capsys):
    checkpoint = shutil.copytree(ROOT / "weights" / "sat", tmp_path / "sat")
    report = json.loads(REPORT.read_text())
    for key, value in change.items():  # the test split's scores keep their other members
        report[key] = {**report[key], **value} if key == "test" else value
    bad = tmp_path / "report.json"
    bad.write_text(json.dumps(report))
    card = (checkpoint / "MODEL_CARD.md").read_bytes()
    assert cli_error(capsys, "card", str(checkpoint), "--report", str(bad)).startswith(f"error: {bad}: ")
    assert (checkpoint / "MODEL_CARD.md").read_bytes() == card


def test_zoo_f8k_names_a_report_whose_decoding_rules_are_not_rules(tmp_path, capsys):
    (tmp_path / "weights").mkdir()
    (tmp_path / "results").mkdir()
    shutil.copytree(ROOT / "weights" / "flickr8k" / "sat", tmp_path / "weights" / "sat")
    report = json.loads((ROOT / "docs" / "results" / "flickr8k" / "sat.json").read_text())
    report["decoding"] = {"beam": 3}
    (tmp_path / "results" / "sat.json").write_text(json.dumps(report))
    message = cli_error(capsys, "zoo-f8k", "--weights-dir", str(tmp_path / "weights"), "--results",
                        str(tmp_path / "results"), "--document", str(tmp_path / "zoo.md"))
    assert message.startswith(f"error: {tmp_path / 'results' / 'sat.json'}: its 'decoding' is")
