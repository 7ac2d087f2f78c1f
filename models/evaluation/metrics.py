"""Caption metrics: BLEU-1..4, METEOR, ROUGE-L through ``pycocoevalcap``, CIDEr-D through the vectorised
:class:`CiderD` below (equal to ``pycocoevalcap``'s to 1e-6, tested); raw scores, not ×100.

``captioner eval`` (:func:`.evaluate.score_dataset`) tokenises captions and references with the project's one tokenizer,
:func:`captioner.models.vocab.tokenize` (lower-case, accents and punctuation dropped), by default;
:func:`score_captions` scores text as given.  coco-caption itself runs Stanford's PTB tokenizer over the
raw references and the captions first (:func:`ptb_tokenize`, ``captioner eval --ptb``): it keeps "t-shirt" one word
and splits "cannot", where the project's tokenizer does the opposite, which moves scores by a few tenths of a point
(docs/decisions.md, "Scoring: the project's tokenizer, and coco-caption's").  SPICE needs models that are
downloaded at first use; it is reported as unavailable rather than faked.  METEOR and the PTB tokenizer run Java
subprocesses and are only used when asked for.
"""

from __future__ import annotations

import math
import shutil
from collections import Counter, defaultdict
from contextlib import suppress
from itertools import count
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

ALL_METRICS = ("BLEU", "METEOR", "ROUGE-L", "CIDEr-D")
UNAVAILABLE = {"SPICE": "needs Stanford CoreNLP models that are downloaded at first use; no download is possible here"}
#: the decimals a report keeps of every score (``captioner eval``, ``tune-decoding``, ``resolution-check``)
REPORT_DECIMALS = 4


def reported(scores: Mapping[str, float]) -> dict[str, float]:
    """``scores`` as a report writes them: each rounded to :data:`REPORT_DECIMALS`."""
    return {name: round(value, REPORT_DECIMALS) for name, value in scores.items()}


def score_captions(candidates: Mapping[int, str], references: Mapping[int, Sequence[str]],
                   metrics: Sequence[str] | str = ALL_METRICS) -> dict[str, float]:
    """Corpus-level scores of ``candidates[id]`` (one caption) against ``references[id]`` (a list of several),
    ``metrics`` among :data:`ALL_METRICS`.  The text is scored as given, words split at spaces: tokenise it first
    (:func:`captioner.models.vocab.tokenize`, or :func:`ptb_tokenize` as coco-caption does), as ``captioner eval``
    does; "A cat." and "a cat" are different words here."""
    metrics = (metrics,) if isinstance(metrics, str) else tuple(metrics)
    unknown = [name for name in metrics if name not in ALL_METRICS]
    if unknown:  # "BLEU-4" asked for scored nothing, in silence
        raise ValueError(f"unknown metric(s) {', '.join(map(repr, unknown))}: choose among {', '.join(ALL_METRICS)}"
                         " (BLEU gives BLEU-1 to BLEU-4)")
    ids = sorted(candidates)
    for i in ids:
        if not isinstance(candidates[i], str):
            raise TypeError(f"candidate {i!r} is a {type(candidates[i]).__name__}: give each caption as a string")
        if i not in references:
            raise ValueError(f"candidate {i!r} has no references")
        # a string is a sequence too: its characters were scored as the references
        if isinstance(references[i], str) or not all(isinstance(ref, str) for ref in references[i]):
            raise TypeError(f"references[{i!r}] must be a list of captions (strings), got {references[i]!r}")
    res = {i: [candidates[i] or "<empty>"] for i in ids}
    gts = {i: list(references[i]) for i in ids}
    scores: dict[str, float] = {}
    if "BLEU" in metrics:
        from pycocoevalcap.bleu.bleu import Bleu

        bleu, _ = Bleu(4).compute_score(gts, res, verbose=0)
        scores.update({f"BLEU-{n + 1}": float(b) for n, b in enumerate(bleu)})
    if "METEOR" in metrics:
        if shutil.which("java") is None:
            raise RuntimeError("METEOR needs Java on PATH")
        from pycocoevalcap.meteor.meteor import Meteor

        scorer = Meteor()
        java = scorer.meteor_p
        try:
            scores["METEOR"] = float(scorer.compute_score(gts, res)[0])
        except (OSError, ValueError) as error:  # Java stopped: a closed pipe written to, an empty line read
            java.kill()
            with suppress(OSError):  # the unwritten rest of its input goes nowhere (__del__'s close would raise)
                java.stdin.close()
            message = java.stderr.read().decode(errors="replace").strip() or f"exit status {java.wait()}"
            raise ChildProcessError(f"coco-caption's METEOR (Java) stopped before scoring: {message}") from error
        finally:
            # compute_score keeps the scorer's lock when it fails, and __del__ takes that lock: it would wait forever
            # wherever the scorer was collected
            if scorer.lock.locked():
                scorer.lock.release()
            del scorer  # its __del__ closes Java's input, stops it and waits for it; its output pipes it leaves open
            for stream in (java.stdout, java.stderr):
                stream.close()
    if "ROUGE-L" in metrics:
        from pycocoevalcap.rouge.rouge import Rouge

        scores["ROUGE-L"] = float(Rouge().compute_score(gts, res)[0])
    if "CIDEr-D" in metrics:
        # the vectorised CIDEr-D below equals coco-caption's "CIDEr" (which is CIDEr-D) and is much faster
        scores["CIDEr-D"] = float(np.mean(cider_d([res[i][0] for i in ids], [gts[i] for i in ids])))
    return scores


def ptb_tokenize(texts: Mapping[Any, Sequence[str]]) -> dict[Any, list[str]]:
    """coco-caption's tokenization of ``texts`` (key → captions): Stanford's PTBTokenizer, lower-cased, with the
    punctuation tokens dropped (pycocoevalcap's ``PTBTokenizer``, a Java subprocess), each caption its tokens joined
    by spaces, in the order given."""
    check_ptb_tokenizer()
    from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

    keys = list(texts)
    # one line per caption (the tokenizer keeps lines): a line break inside one (\r, \u2028, … which the wrapper does
    # not replace) would shift every later caption
    lines = {index: [{"caption": " ".join(text.split()) or "<empty>"} for text in texts[key]]
             for index, key in enumerate(keys)}
    tokenized = PTBTokenizer().tokenize(lines)
    # the wrapper checks neither Java's exit status nor the lines it got back: a failed run would score captions
    # against empty or shifted references
    if any(len(tokenized.get(index, ())) != len(texts[key]) for index, key in enumerate(keys)):
        raise ChildProcessError("coco-caption's PTB tokenizer (Java) did not return one line per caption: see its "
                                "messages above")
    return {key: tokenized[index] if texts[key] else [] for index, key in enumerate(keys)}


def check_ptb_tokenizer() -> None:
    """Refuse (:class:`ChildProcessError`) before any work where the PTB tokenizer cannot run: it needs Java."""
    if shutil.which("java") is None:
        raise ChildProcessError("coco-caption's PTB tokenizer needs Java on PATH (scoring with --ptb)")


def ptb_captions(captions: Mapping[Any, str]) -> dict[Any, str]:
    """One caption per key through :func:`ptb_tokenize` (one Java run for all of them); a caption of punctuation
    alone comes back as ``"<empty>"``, as :func:`score_captions` scores an empty one."""
    return {key: texts[0] or "<empty>"
            for key, texts in ptb_tokenize({key: [text] for key, text in captions.items()}).items()}


def reference_texts(images: Sequence[Any], ptb: bool = False) -> list[list[str]]:
    """Each image's references as the scorers read them: the project's tokens joined by spaces, or with ``ptb``
    their raw texts (``raw_references``; the joined tokens where a data set has none) through :func:`ptb_tokenize`."""
    if not ptb:
        return [[" ".join(reference) for reference in image.references] for image in images]
    raw = ptb_tokenize({index: image.raw_references or [" ".join(r) for r in image.references]
                        for index, image in enumerate(images)})
    return [raw[index] for index in range(len(images))]


def unigram_misses(captions: Mapping[int, Sequence[str]],
                   references: Mapping[int, Sequence[Sequence[str]]]) -> tuple[Counter, int]:
    """The caption words BLEU-1 does not credit, and the number of caption words: a word counts against a caption as
    often as it occurs beyond the most times any one reference of the image holds it (the clipped unigram counts of
    Papineni et al. 2002, §2.1, taken from coco-caption's own ``cook_refs``, as ``bleu_statistics`` in compare.py
    takes them).  ``1 − misses / words`` is BLEU-1's modified precision, which is BLEU-1 itself where no brevity
    penalty applies (docs/decisions.md, "Flickr8k: BLEU-1 and the brevity penalty"): this says which words make up
    the rest."""
    from pycocoevalcap.bleu.bleu_scorer import cook_refs

    misses: Counter = Counter()
    words = 0
    for image_id, caption in captions.items():
        _, most = cook_refs([" ".join(reference) for reference in references[image_id]], n=1)
        for word, times in Counter(caption).items():
            words += times
            uncredited = times - most.get((word,), 0)
            if uncredited > 0:
                misses[word] += uncredited
    return misses, words


def _sorted_unique(values: np.ndarray) -> np.ndarray:
    """``np.unique`` by sorting (NumPy 2's hash-based ``np.unique`` is several times slower on int64 keys)."""
    values = np.sort(values)
    keep = np.ones(len(values), dtype=bool)
    keep[1:] = values[1:] != values[:-1]
    return values[keep]


class CiderD:
    """CIDEr-D of single captions with document frequencies fixed from a reference corpus: the SCST reward
    (Rennie et al., "Self-critical Sequence Training for Image Captioning", arXiv:1612.00563; document frequencies
    from the training-split references: docs/decisions.md#scst-samples-and-reward-statistics) and the ``CIDEr-D`` of
    ``captioner eval``.

    CIDEr-D (Vedantam et al., "CIDEr: Consensus-based Image Description Evaluation", arXiv:1411.5726, Eq. 2–5 and
    the "-D" changes of its coco-caption release) of a candidate ``c`` against references ``S``::

        g^n(s)        = tf(ω, s) · (log |corpus| − log max(1, df(ω)))          for every n-gram ω of order n
        CIDEr-D_n     = 10/|S| Σ_s  Σ_ω min(g^n_ω(c), g^n_ω(s)) g^n_ω(s) / (‖g^n(c)‖ ‖g^n(s)‖) · exp(−Δℓ²/2σ²)
        CIDEr-D       = mean over n = 1..4 of CIDEr-D_n

    with ``Δℓ`` the difference of the bigram counts of ``c`` and ``s`` (coco-caption measures length in bigrams)
    and σ = 6.  This is exactly ``pycocoevalcap``'s ``Cider`` (which is CIDEr-D) when ``corpus`` is the set of
    references being scored (:func:`cider_d`); tests/test_cider.py checks the equality to 1e-6.

    Vectorised: words get integer ids once (the only per-word Python work), every n-gram becomes one ``uint64``
    code (16 bits per word), and term frequencies, tf-idf weights, norms and the clipped dot products of every
    (candidate, reference) pair are sorted-array joins and ``bincount`` sums in NumPy.  pycocoevalcap instead
    loops over n-gram dictionaries in Python for every pair; see benchmarks/bench_cider.py for the ratio.
    """

    WORD_BITS = 16  # a 4-gram of 16-bit word ids fills a uint64

    def __init__(self, corpus: Iterable[Sequence[str]], n: int = 4, sigma: float = 6.0):
        self.n, self.sigma = n, sigma
        # word → id, a new word getting the next id inside the C-level lookup (no separate pass over the words);
        # id 0 is the sentence separator of :meth:`_ngrams`
        self.word_ids: defaultdict[str, int] = defaultdict(count().__next__)
        self.word_ids["\0"]
        corpus = [list(references) for references in corpus]  # one entry per image: its reference captions
        self._set_document_frequencies(self._ngrams([ref for refs in corpus for ref in refs]),
                                       np.repeat(np.arange(len(corpus)), [len(refs) for refs in corpus]))
        self.log_corpus = math.log(float(max(len(corpus), 1)))

    def _set_document_frequencies(self, grams: list, image_of_sentence: np.ndarray, first: int = 0) -> None:
        """df of every n-gram: the number of images with it in at least one of their references (sentences
        ``first…`` of ``grams``, sentence ``first + j`` belonging to image ``image_of_sentence[j]``)."""
        self._df_codes, self._df_counts = [], []
        for sentence, gram, _, codes in grams:
            keep = sentence >= first
            image_gram = _sorted_unique(image_of_sentence[sentence[keep] - first] * len(codes) + gram[keep])
            counts = np.bincount(image_gram % max(len(codes), 1), minlength=len(codes))
            self._df_codes.append(codes[counts > 0])
            self._df_counts.append(counts[counts > 0].astype(np.float64))

    # -- n-grams -------------------------------------------------------------------------------------------------
    def _ngrams(self, sentences: Sequence[str]) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
        """Per order ``k = 1..n``: ``(sentence, gram, tf, codes)``, one entry per distinct n-gram of a sentence,
        sorted by sentence then gram; ``gram`` indexes the sorted table ``codes`` of the n-grams' uint64 codes.
        Splitting on whitespace is ``pycocoevalcap``'s ``precook``."""
        # one C-level split of the joined text; a separator token (never produced by splitting a sentence, as it
        # holds no whitespace but is not a word we could meet: it contains a NUL) marks the sentence ends
        separator = "\0"
        tokens = f" {separator} ".join(sentences).split() + [separator] if len(sentences) else []
        ids = self.word_ids
        with_separators = np.fromiter(map(ids.__getitem__, tokens), dtype=np.uint64, count=len(tokens))
        if len(ids) > 1 << self.WORD_BITS:
            raise ValueError(f"more than {(1 << self.WORD_BITS) - 1} distinct words: n-gram codes would overflow")
        is_word = with_separators != 0
        ends = np.nonzero(~is_word)[0]
        lengths = np.diff(np.concatenate([[-1], ends])) - 1  # words per sentence
        flat = with_separators[is_word]
        sentence_of = np.repeat(np.arange(len(sentences)), lengths)
        remaining = np.repeat(np.cumsum(lengths), lengths) - np.arange(len(flat))  # words from i to the end
        out = []
        code = np.zeros(len(flat), dtype=np.uint64)
        for k in range(1, self.n + 1):
            # code of the k-gram starting at i: (code of the (k−1)-gram at i) << 16 | word i+k−1
            code <<= np.uint64(self.WORD_BITS)
            code[:max(len(flat) - k + 1, 0)] |= flat[k - 1:]
            starts = np.nonzero(remaining >= k)[0]
            gram_codes = code[starts]
            if k == 1:  # a unigram's code is its word id: already a dense index
                codes, gram = np.arange(len(ids), dtype=np.uint64), gram_codes.astype(np.int64)
            else:
                order = np.argsort(gram_codes)
                is_new = np.ones(len(order), dtype=bool)
                is_new[1:] = gram_codes[order[1:]] != gram_codes[order[:-1]]
                codes = gram_codes[order[is_new]]  # the distinct codes, sorted
                gram = np.empty(len(order), dtype=np.int64)
                gram[order] = np.cumsum(is_new) - 1  # index of each n-gram's code in ``codes``
            # (sentence, gram) as one int64 key: sorting it groups equal n-grams of a sentence (their tf); the gram
            # takes the low bits so that shifts and masks split the key again (cheaper than // and %)
            bits = max(int(len(codes)).bit_length(), 1)
            key = np.sort((sentence_of[starts] << bits) | gram)
            first = np.ones(len(key), dtype=bool)
            first[1:] = key[1:] != key[:-1]
            run_starts = np.nonzero(first)[0]
            tf = np.diff(np.append(run_starts, len(key))).astype(np.float64)
            unique_keys = key[run_starts]
            out.append((unique_keys >> bits, unique_keys & ((1 << bits) - 1), tf, codes))
        return out

    def _document_frequency(self, order: int, codes: np.ndarray) -> np.ndarray:
        known, counts = self._df_codes[order], self._df_counts[order]
        if not len(known):
            return np.zeros(len(codes))
        at = np.searchsorted(known, codes).clip(max=len(known) - 1)
        return np.where(known[at] == codes, counts[at], 0.0)

    # -- scoring -------------------------------------------------------------------------------------------------
    def score(self, captions: Sequence[str], references: Sequence[Sequence[str]]) -> np.ndarray:
        """CIDEr-D of ``captions[i]`` against ``references[i]`` (several strings).  Reference lists that are the
        same object (SCST repeats an image's list for each of its samples) are processed once."""
        if len(captions) != len(references):
            raise ValueError(f"{len(captions)} captions but {len(references)} reference lists")
        if not captions:
            return np.zeros(0)
        set_of: dict[int, int] = {}
        ref_sets: list[Sequence[str]] = []
        candidate_set = np.empty(len(captions), dtype=np.int64)
        for i, refs in enumerate(references):
            if id(refs) not in set_of:
                set_of[id(refs)] = len(ref_sets)
                ref_sets.append(refs)
            candidate_set[i] = set_of[id(refs)]
        set_sizes = np.array([len(refs) for refs in ref_sets], dtype=np.int64)
        if (set_sizes == 0).any():
            raise ValueError("every caption needs at least one reference")
        grams = self._ngrams(list(captions) + [ref for refs in ref_sets for ref in refs])
        return self._score(grams, candidate_set, set_sizes)

    def _score(self, grams: list, candidate_set: np.ndarray, set_sizes: np.ndarray) -> np.ndarray:
        """Scores from the n-grams of the captions (sentences ``0…C−1``) followed by those of the reference
        sets (set ``s`` holds ``set_sizes[s]`` sentences); caption ``c`` is scored against set ``candidate_set[c]``."""
        set_start = np.cumsum(set_sizes) - set_sizes
        num_captions, num_refs = len(candidate_set), int(set_sizes.sum())

        # (candidate, reference) pairs: candidate c meets every reference of its set
        pair_candidate = np.repeat(np.arange(num_captions), set_sizes[candidate_set])
        within = np.arange(len(pair_candidate)) - np.repeat(np.cumsum(set_sizes[candidate_set])
                                                            - set_sizes[candidate_set], set_sizes[candidate_set])
        pair_ref = set_start[candidate_set][pair_candidate] + within  # index among the references
        num_pairs = len(pair_candidate)
        # pairs are (reference 0, 1, 2, …) in order: no reference is shared by several captions
        one_pair_per_reference = num_pairs == num_refs and bool((pair_ref == np.arange(num_refs)).all())

        similarity = np.zeros((num_pairs, self.n))
        lengths = np.zeros(num_captions + num_refs)
        for order, (sentence, gram, tf, codes) in enumerate(grams):
            idf = self.log_corpus - np.log(np.maximum(1.0, self._document_frequency(order, codes)))
            weight = tf * idf[gram]
            norm = np.sqrt(np.bincount(sentence, weight * weight, minlength=num_captions + num_refs))
            if order == 1:  # coco-caption's length: the number of bigrams
                lengths = np.bincount(sentence, tf, minlength=num_captions + num_refs)
            first_ref = int(np.searchsorted(sentence, num_captions))  # entries are sorted: captions come first
            vocabulary = max(len(codes), 1)  # (candidate, n-gram) as one sortable int64 key
            hyp_key = sentence[:first_ref] * vocabulary + gram[:first_ref]  # sorted, as the entries are
            hyp_weight = weight[:first_ref]
            # every reference entry, once per pair that uses the reference
            ref_rows = np.arange(first_ref, len(sentence))
            if one_pair_per_reference:  # every reference meets exactly one caption, in order (cider_d's case)
                pair_of_entry, entry = sentence[ref_rows] - num_captions, ref_rows
            else:
                ref_entry_start = np.searchsorted(sentence[ref_rows], num_captions + np.arange(num_refs))
                ref_entry_count = np.diff(np.append(ref_entry_start, len(ref_rows)))
                per_pair = ref_entry_count[pair_ref]
                pair_of_entry = np.repeat(np.arange(num_pairs), per_pair)
                entry = ref_rows[np.repeat(ref_entry_start[pair_ref], per_pair) + np.arange(int(per_pair.sum()))
                                 - np.repeat(np.cumsum(per_pair) - per_pair, per_pair)]
            key = pair_candidate[pair_of_entry] * vocabulary + gram[entry]
            at = np.searchsorted(hyp_key, key).clip(max=max(len(hyp_key) - 1, 0))
            match = (hyp_key[at] == key) if len(hyp_key) else np.zeros(len(key), dtype=bool)
            ref_weight = weight[entry[match]]
            clipped = np.minimum(hyp_weight[at[match]], ref_weight) * ref_weight  # clipped counts (the "-D")
            dot = np.bincount(pair_of_entry[match], clipped, minlength=num_pairs)
            denominator = norm[pair_candidate] * norm[num_captions + pair_ref]
            similarity[:, order] = np.where(denominator != 0, dot / np.where(denominator != 0, denominator, 1.0),
                                            dot)
        delta = lengths[pair_candidate] - lengths[num_captions + pair_ref]
        similarity *= np.exp(-(delta ** 2) / (2 * self.sigma ** 2))[:, None]  # length penalty (the "-D")
        per_candidate = np.bincount(pair_candidate, similarity.mean(1), minlength=num_captions)
        return 10.0 * per_candidate / set_sizes[candidate_set]


def cider_d(candidates: Sequence[str], references: Sequence[Sequence[str]]) -> np.ndarray:
    """Per-caption CIDEr-D with document frequencies from ``references`` themselves: what ``pycocoevalcap``'s
    ``Cider().compute_score`` returns (its mean is the corpus score), computed by :class:`CiderD`."""
    if len(candidates) != len(references):
        raise ValueError(f"{len(candidates)} captions but {len(references)} reference lists")
    # one n-gram pass over captions and references serves both the document frequencies and the scores
    scorer = CiderD([])
    set_sizes = np.array([len(refs) for refs in references], dtype=np.int64)
    if (set_sizes == 0).any():
        raise ValueError("every caption needs at least one reference")
    grams = scorer._ngrams(list(candidates) + [ref for refs in references for ref in refs])
    scorer._set_document_frequencies(grams, np.repeat(np.arange(len(references)), set_sizes), first=len(candidates))
    scorer.log_corpus = math.log(float(max(len(references), 1)))
    return scorer._score(grams, np.arange(len(candidates)), set_sizes)
