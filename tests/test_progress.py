"""Progress bars (models/progress.py): tqdm's on a terminal; in a log, a line of their own at most once a minute,
with no carriage return, so that a training run's log of hours reads line by line."""

import io
import time

from tqdm import tqdm

from captioner.models.progress import LOG_INTERVAL_S, progress_bar, write_above


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_in_a_log_a_bar_is_plain_lines_at_most_one_a_minute():
    log = io.StringIO()
    with progress_bar(range(5000), desc="xe epoch 1/8", unit="batch", dynamic_ncols=True, file=log) as bar:
        for _ in bar:  # far less than LOG_INTERVAL_S: the first and the last state only
            pass
    assert LOG_INTERVAL_S == 60
    assert "\r" not in log.getvalue() and log.getvalue().endswith("\n")
    lines = log.getvalue().splitlines()
    assert 2 <= len(lines) <= 3 and all(line.startswith("xe epoch 1/8: ") for line in lines)
    assert "0/5000" in lines[0] and "5000/5000" in lines[-1]


def test_in_a_log_a_bar_updated_every_ten_seconds_writes_a_line_a_minute(monkeypatch):
    """The minute between two lines is the log's own default: tqdm's is a tenth of a second, so a bar of an hour's
    epoch updated every ten seconds would write a line at each update (tqdm's clock is stood in for here)."""
    clock = [1000.0]
    monkeypatch.setattr("tqdm.std.time", lambda: clock[0])
    log = io.StringIO()
    bar = progress_bar(total=12, desc="xe epoch 1/8", file=log)
    for _ in range(12):
        clock[0] += 10
        bar.update(1)
    bar.close()
    lines = log.getvalue().splitlines()
    assert [line.split("|")[0] for line in lines] == [
        "xe epoch 1/8:   0%", "xe epoch 1/8:  50%", "xe epoch 1/8: 100%", "xe epoch 1/8: 100%"], lines


def test_in_a_log_tqdms_monitor_adds_no_line_between_two(monkeypatch):
    """tqdm's monitor thread redraws a bar that has not been drawn for ``maxinterval`` once its redraw stride has
    grown: in a log, a second line within the interval.  Here at a tenth of a second's pace: the bar's lines are its
    first, one an interval at most, and its last two."""
    if tqdm.monitor is not None:  # a monitor started by an earlier bar sleeps 10 s between looks
        tqdm.monitor.exit()
    monkeypatch.setattr(tqdm, "monitor_interval", 0.02)
    log = io.StringIO()
    try:
        bar = progress_bar(total=400, desc="xe epoch 1/1", mininterval=0.5, maxinterval=0.05, file=log)
        start = time.monotonic()
        for _ in range(400):
            time.sleep(0.004)
            bar.update(1)
        bar.close()
        elapsed = time.monotonic() - start
    finally:
        if tqdm.monitor is not None:
            tqdm.monitor.exit()
    lines = log.getvalue().splitlines()
    assert len(lines) <= 1 + int(elapsed / 0.5) + 2, (elapsed, lines)


def test_in_a_log_every_redraw_is_a_line_and_a_message_is_a_line_between_them():
    log = io.StringIO()
    bar = progress_bar(total=4, desc="captioning", mininterval=0, file=log)
    bar.update(2)
    write_above(bar, "b.jpg: not an image")
    bar.update(2)
    bar.close()
    lines = log.getvalue().split("\n")
    assert lines[-1] == "" and "\r" not in log.getvalue()
    assert [line.split("|")[0] for line in lines[:-1]] == [
        "captioning:   0%", "captioning:  50%", "b.jpg: not an image", "captioning:  50%", "captioning: 100%",
        "captioning: 100%"]
    assert all(line == line.rstrip() for line in lines)  # no spaces left from wiping a longer redraw


def test_on_a_terminal_the_bar_is_redrawn_in_place():
    terminal = Terminal()
    with progress_bar(total=3, desc="encoding images", mininterval=0, file=terminal) as bar:
        bar.update(3)
    assert terminal.getvalue().count("\r") >= 2 and terminal.getvalue().count("\n") == 1
    # a terminal's bar follows its width when asked to; a log has none to follow
    for stream, follows in ((Terminal(), True), (io.StringIO(), False)):
        with progress_bar(total=1, dynamic_ncols=True, file=stream) as bar:
            assert bool(bar.dynamic_ncols) is follows


def test_disable_none_writes_nothing_off_a_terminal_and_a_disabled_bars_message_goes_to_stderr(capsys):
    log = io.StringIO()
    with progress_bar(range(10), disable=None, file=log) as bar:
        for _ in bar:
            pass
    assert log.getvalue() == ""
    bar = progress_bar(total=1, disable=True)
    write_above(bar, "c.jpg: truncated")
    assert capsys.readouterr().err == "c.jpg: truncated\n"


class Closed(io.StringIO):
    """A stream whose ``isatty`` raises as a closed file's does, while it can still be written."""

    def isatty(self) -> bool:
        raise ValueError("I/O operation on closed file")


class Flushes(io.StringIO):
    def __init__(self):
        super().__init__()
        self.flushes = 0

    def flush(self) -> None:
        self.flushes += 1


def test_a_stream_that_cannot_say_it_is_a_terminal_gets_lines(capsys):
    log = Closed()
    with progress_bar(total=2, desc="encoding", mininterval=0, file=log) as bar:
        bar.update(2)
    assert "\r" not in log.getvalue() and log.getvalue().splitlines()[-1].startswith("encoding: 100%")


def test_a_bar_writes_to_standard_error_by_default_and_flushes_each_line(capsys):
    with progress_bar(total=2, desc="scoring", mininterval=0) as bar:
        bar.update(2)
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.splitlines()[-1].startswith("scoring: 100%")
    log = Flushes()
    with progress_bar(total=2, mininterval=0, file=log) as bar:  # a log file is read while the run goes on
        bar.update(1)
        assert log.flushes >= 2  # the first line and this one


class WriteOnly:
    """A stream with ``write`` and ``flush`` alone (a logging adapter, say): it has no ``isatty`` to ask."""

    def __init__(self):
        self.text = ""

    def write(self, text: str) -> None:
        self.text += text

    def flush(self) -> None:
        pass


def test_a_stream_without_isatty_gets_lines():
    log = WriteOnly()
    with progress_bar(total=2, desc="encoding", mininterval=0, file=log) as bar:
        bar.update(2)
    assert "\r" not in log.text and log.text.splitlines()[-1].startswith("encoding: 100%")


def test_on_a_terminal_the_bar_keeps_tqdms_own_redraw_pace():
    """The once-a-minute pace and the fixed stride are a log's: a terminal's bar is redrawn as tqdm's own is."""
    own = tqdm(total=3, file=Terminal())
    with progress_bar(total=3, file=Terminal()) as bar:
        assert (bar.mininterval, bar.miniters, bar.dynamic_miniters) == (
            own.mininterval, own.miniters, own.dynamic_miniters)
    own.close()


def test_in_a_log_a_message_before_the_bars_first_line_has_no_blank_line_above_it():
    """A bar with ``delay`` draws nothing at first: the message is the log's first line (tqdm's wipe of the bar
    before it is empty and must not count as a line begun)."""
    log = io.StringIO()
    bar = progress_bar(total=4, desc="captioning", delay=30, file=log)
    write_above(bar, "a.jpg: not an image")
    bar.close()
    assert log.getvalue().split("\n")[0] == "a.jpg: not an image"
