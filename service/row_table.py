"""The batcher's decoding state: a :class:`Job` per caption request and the :class:`RowTable` of (job, beam) rows
that one decoding step advances together (:mod:`captioner.service.batcher` decides who joins and leaves a table and
when it steps).

Every row's arithmetic is :func:`captioner.models.decoding.beam_search`'s (the same step, the same per-group top-k
of :func:`captioner.models.decoding.beam_step`), so a job's caption does not depend on the rows beside it.  Jobs
join a table at a step boundary (their encoder state written into buffers with room to grow) and leave it when
they finish or are cancelled (the staying rows compacted with as few moves as the beam widths allow:
:func:`fill_holes`).
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from captioner.models.decoding import NO_RULES, BeamLayout, DecodingRules, RowHistory, StepRecord, backtrack, \
    beam_step, block_rows, collect_hypotheses, host_index, record_step
from captioner.models.inference import CaptionResult, Prepared, Runtime
from captioner.models.protocol import index_rows


@dataclass(eq=False)
class Job:
    """One caption request inside the batcher."""

    prepared: Prepared
    beam_size: int
    max_len: int
    deadline: float  # value of the batcher's clock (time.monotonic unless a test injects one)
    loop: asyncio.AbstractEventLoop = field(repr=False)
    future: asyncio.Future = field(repr=False)
    enqueued: float = field(default_factory=time.monotonic)
    cancelled: bool = False  # set from the event loop; read by the worker at step boundaries
    cancel_reason: str = "cancelled"  # label of the freed rows: "cancelled" (client gone) or "deadline"
    steps: int = 0
    # whether its caption length is a sample of real ones (not the artificial length of a warm-up round); fixed at
    # submission, since the worker may measure the job after warm-up has moved on
    typical_length: bool = True
    first_record: int = 0  # index (in its table's record numbering) of the first step this job took part in
    rules: DecodingRules = NO_RULES  # length penalty and trigram blocking of its beam search
    #: the context it was submitted in (the request's: its id), for the lines the worker thread logs about it
    context: contextvars.Context = field(default_factory=contextvars.copy_context, repr=False)

    def resolve(self, result: Any = None, error: BaseException | None = None) -> None:
        """Complete the future from the worker thread (futures belong to the event loop)."""
        def complete() -> None:
            if self.future.done():
                return
            if error is not None:
                self.future.set_exception(error)
            else:
                self.future.set_result(result)

        try:
            self.loop.call_soon_threadsafe(complete)
        except RuntimeError:  # the event loop is closed: nobody is waiting any more
            pass


class RowTable:
    """The (job, beam) rows decoded together: every tensor holds one row per beam of each job, job by job."""

    def __init__(self, jobs: list[Job], enc: dict, state: dict, bos_id: int):
        self.jobs = list(jobs)
        # encoder state lives in buffers with room to grow: the rows of the jobs that join are written after the
        # others instead of concatenating (copying) the whole table's image features at every admission
        self._enc_buffers, self.state = dict(enc), state
        self.layout = BeamLayout([j.beam_size for j in jobs], self._device)
        self.prev, self.scores, self.finished = self.layout.initial_rows(bos_id)
        # what the jobs' decoding rules need of every row; None while no job of the table has a rule
        self.history = self._history(jobs) if any(j.rules.active for j in jobs) else None
        self.records: list[StepRecord] = []
        self.records_base = 0  # record number of self.records[0]
        # row i of the next step's input continues row parent_map[i] of the last record (None: identity)
        self.parent_map: torch.Tensor | None = None
        for job in jobs:
            job.first_record = 0

    @property
    def _device(self) -> torch.device:
        return next(iter(self.state.values())).device

    @property
    def rows(self) -> int:
        return self.layout.rows

    @property
    def enc(self) -> dict:
        """The encoder state of the table's rows (views of the first ``rows`` rows of the buffers)."""
        rows = self.rows
        return {k: v[:rows] for k, v in self._enc_buffers.items()}

    @staticmethod
    def signature(enc: dict, state: dict) -> tuple:
        """Rows can share a table when every tensor has the same shape apart from the row axis."""
        return tuple((f"{kind}.{key}", tuple(value.shape[1:]), value.dtype)
                     for kind, tensors in (("enc", enc), ("state", state)) for key, value in sorted(tensors.items()))

    def current_signature(self) -> tuple:
        return self.signature(self.enc, self.state)

    def next_record(self) -> int:
        return self.records_base + len(self.records)

    def _history(self, jobs: list[Job], rules: bool = True) -> RowHistory:
        """Fresh histories for the rows of ``jobs``, with their rules (``rules=False``: without, for rows that
        were decoding before the first job with a rule joined, whose histories are never read)."""
        return RowHistory.start([j.beam_size for j in jobs], [j.rules if rules else NO_RULES for j in jobs],
                                max(j.max_len for j in jobs), self._device)

    def add(self, jobs: list[Job], enc: dict, state: dict, bos_id: int) -> None:
        """Append the rows of newly admitted jobs (their decoding starts at the next step)."""
        device = self._device
        new_rows = sum(j.beam_size for j in jobs)
        parent_map = self.parent_map if self.parent_map is not None else torch.arange(self.rows, device=device)
        self.parent_map = torch.cat([parent_map, torch.zeros(new_rows, dtype=torch.long, device=device)])
        rows, needed = self.rows, self.rows + new_rows
        for key, buffer in self._enc_buffers.items():
            if buffer.shape[0] < needed:  # grow geometrically: amortised, each row is copied O(1) times
                grown = buffer.new_empty((max(needed, 2 * buffer.shape[0]), *buffer.shape[1:]))
                grown[:rows] = buffer[:rows]
                self._enc_buffers[key] = buffer = grown
            buffer[rows:needed] = enc[key]
        self.state = {k: torch.cat([v, state[k]]) for k, v in self.state.items()}
        fresh = BeamLayout([j.beam_size for j in jobs], device).initial_rows(bos_id)
        self.prev, self.scores, self.finished = (torch.cat([old, new]) for old, new in
                                                 zip((self.prev, self.scores, self.finished), fresh))
        if self.history is not None or any(j.rules.active for j in jobs):
            before = self.history if self.history is not None else self._history(self.jobs, rules=False)
            self.history = before.cat(self._history(jobs))
        for job in jobs:
            job.first_record = self.next_record()
        self.jobs += jobs
        self.layout = BeamLayout([j.beam_size for j in self.jobs], device)

    def remove(self, leaving: set[Job], runtime: Runtime) -> None:
        """Drop the rows of ``leaving`` jobs.  The encoder state, the largest part of a table (every row holds its
        image's features), is compacted by moving only the jobs that lie past the new end into the holes left
        behind (:func:`fill_holes`); copying every row instead cost a quarter of a 96-row SAT step, and under
        load some request finishes at almost every step.  Jobs change places; ``parent_map`` records it."""
        staying = [(job, offset, size) for job, offset, size in zip(self.jobs, self.layout.offsets, self.layout.sizes)
                   if job not in leaving]
        self.jobs = [job for job, _, _ in staying]
        if not self.jobs:
            return
        device = self._device
        placed = fill_holes([(offset, size) for _, offset, size in staying])
        order = [i for i, _ in placed] if placed is not None else range(len(staying))
        keep = host_index(block_rows((staying[i][1], staying[i][2]) for i in order), device)
        if placed is None:  # widths that do not fit the holes: select every staying row
            self._enc_buffers = index_rows(self.enc, keep)
        else:
            moves = [(staying[i][1], new, staying[i][2]) for i, new in placed if staying[i][1] != new]
            if moves:
                source = host_index(block_rows((old, size) for old, _, size in moves), device)
                target = host_index(block_rows((new, size) for _, new, size in moves), device)
                for buffer in self._enc_buffers.values():
                    # index_select reads every moving row before any is written: a target may overlap another
                    # block's old rows
                    buffer.index_copy_(0, target, buffer.index_select(0, source))
        self.jobs = [staying[i][0] for i in order]
        self.parent_map = keep if self.parent_map is None else self.parent_map.index_select(0, keep)
        # decoder state through the runtime's reorder hook (the model's, or the exported graphs' row selection)
        self.state = runtime.reorder(self.state, keep)
        self.prev, self.scores = self.prev.index_select(0, keep), self.scores.index_select(0, keep)
        self.finished = self.finished.index_select(0, keep)
        self.history = self.history.select(keep) if any(j.rules.active for j in self.jobs) else None
        self.layout = BeamLayout([j.beam_size for j in self.jobs], device)
        # history older than every remaining job's first step is no longer reachable
        oldest = min(j.first_record for j in self.jobs)
        if oldest > self.records_base:
            del self.records[:oldest - self.records_base]
            self.records_base = oldest

    def step(self, runtime: Runtime) -> list[bool]:
        """One decoding step over every row; returns, per job, whether all its beams have emitted EOS."""
        logprobs, state, attn = runtime.step(self.prev, self.state, self.enc)
        step = beam_step(logprobs, self.scores, self.finished, self.layout, self.prev, runtime.bos_id, runtime.eos_id,
                         runtime.never_emitted, self.history)
        if self.history is not None:
            self.history = self.history.after(step, self.finished)
        parent = step.pointer if self.parent_map is None else self.parent_map.index_select(0, step.pointer)
        self.records.append(record_step(step, attn, parent))
        self.parent_map = None
        self.state = runtime.reorder(state, step.pointer)
        self.scores, self.finished, self.prev = step.scores, step.finished, step.tokens
        for job in self.jobs:
            job.steps += 1
        return self.layout.groups_done(self.finished).tolist()  # the one host synchronisation of the step

    def finished_jobs(self, done: list[bool]) -> list[Job]:
        """The jobs a step (its ``done`` flags) has finished: every beam has emitted EOS or the job has run its
        ``max_len`` steps.  A cancelled job is not among them: its rows leave without a result."""
        return [job for job, all_eos in zip(self.jobs, done)
                if not job.cancelled and (all_eos or job.steps >= job.max_len)]

    def results_of(self, jobs: list[Job], runtime: Runtime) -> list[CaptionResult]:
        """The best hypothesis of each of ``jobs`` (their rows must still be in the table).

        One backtrack over the rows of all of them and one copy to the host of each map it gives (tokens,
        log-probabilities, attention, each extra) and of the scores, however many finish at this step: a job
        that joined later simply drops the history columns from before its first step.
        """
        groups = [self.jobs.index(job) for job in jobs]
        rows = host_index(block_rows((self.layout.offsets[g], self.layout.sizes[g]) for g in groups), self._device)
        first = min(job.first_record for job in jobs)
        history = backtrack(self.records[first - self.records_base:], rows)
        history = {name: value.cpu() for name, value in history.items()}
        scores = self.scores.index_select(0, rows).cpu()
        results, start = [], 0
        for job in jobs:
            skip = job.first_record - first
            mine = {name: value[start:start + job.beam_size, skip:] for name, value in history.items()}
            best = collect_hypotheses(mine, scores[start:start + job.beam_size], runtime.eos_id, 1,
                                      job.rules.length_penalty)[0]
            results.append(runtime.result(best, job.prepared.geometry, job.beam_size, job.rules))
            start += job.beam_size
        return results


def fill_holes(blocks: list[tuple[int, int]]) -> list[tuple[int, int]] | None:
    """Where the staying jobs' row blocks ``(offset, size)`` (in table order) go when the rows of the others are
    dropped: ``(block index, new offset)`` in the new table order.  Every block that already lies within the
    compacted length keeps its offset; the others fill the holes, first fit, in their order.  None when they do
    not fill the holes exactly (mixed beam widths); the caller then keeps the order and moves every row."""
    total = sum(size for _, size in blocks)
    anchored = [i for i, (offset, size) in enumerate(blocks) if offset + size <= total]
    movers = [i for i, (offset, size) in enumerate(blocks) if offset + size > total]
    placed = [(i, blocks[i][0]) for i in anchored]
    holes, cursor = [], 0
    for offset, size in sorted(blocks[i] for i in anchored) + [(total, 0)]:
        if offset > cursor:
            holes.append((cursor, offset - cursor))
        cursor = offset + size
    for start, length in holes:
        while length:
            fit = next((i for i in movers if blocks[i][1] <= length), None)
            if fit is None:
                return None
            movers.remove(fit)
            placed.append((fit, start))
            start, length = start + blocks[fit][1], length - blocks[fit][1]
    return sorted(placed, key=lambda item: item[1])
