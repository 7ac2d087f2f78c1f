"""Percentile bootstrap over images, shared by attention grounding and the paired comparison of checkpoints.

Images are resampled with replacement and a statistic pooled over them (a ratio of per-image sums) recomputed,
so everything measured on one image travels together (a cluster bootstrap).
"""

from __future__ import annotations

import numpy as np


def resampled_ratios(sums: np.ndarray, counts: np.ndarray, resamples: int, seed: int) -> np.ndarray:
    """``Σ sums / Σ counts`` over ``resamples`` bootstrap samples of the images (rows of ``sums``; its trailing
    axes, if any, are statistics resampled together)."""
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(counts), size=(resamples, len(counts)))
    totals = counts[picks].sum(1)
    return sums[picks].sum(1) / totals.reshape(totals.shape + (1,) * (sums.ndim - 1))


def resample_counts(images: int, resamples: int, seed: int) -> np.ndarray:
    """How often each image is drawn (columns) in each of ``resamples`` bootstrap samples (rows), from the same
    draws as :func:`resampled_ratios` with the same seed; ``counts @ per_image_rows`` sums any per-image
    statistics over every sample at once."""
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, images, size=(resamples, images))
    flat = (np.arange(resamples)[:, None] * images + picks).ravel()
    return np.bincount(flat, minlength=resamples * images).reshape(resamples, images).astype(np.float64)


def percentile_interval(samples: np.ndarray, level: float = 0.95) -> tuple[float, float]:
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(samples, [tail, 100 - tail], axis=0)
    return float(low), float(high)
