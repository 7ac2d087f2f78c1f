"""The papers' training schedules as small objects, each a pure function of where training is (epoch, optimiser
step) plus, for the plateau rule, the validation scores seen so far.

* :class:`StepDecay` — ``lr · factor^k`` where ``k`` counts the decay points passed: every ``every`` epochs from
  ``start`` (AoANet, Huang et al. 2019, arXiv:1908.06954 §3.4: ×0.8 every 3 epochs; SparseCap, Martins et al.,
  arXiv:2002.05556 §4: ×0.99 per epoch after epoch 10) and/or at explicit ``milestones`` (``--lr-drop``).
* :class:`NoamWarmup` — ``f · d^{-1/2} · min(s^{-1/2}, s · w^{-3/2})`` at 1-based step ``s`` (Vaswani et al. 2017,
  arXiv:1706.03762 §5.3 Eq. 3; used by X-LAN, Pan et al. 2020, arXiv:2003.14080 §4.1 with ``w = 10,000``).
* :class:`PlateauDecay` — multiply by ``factor`` when the validation score has not improved for ``patience``
  validations (AoANet §3.4's SCST stage: ×0.5 "when the score on the validation split does not improve").
* :class:`ScheduledSampling` — ``p_ss = min(cap, increase · ⌊(epoch - start) / every⌋)`` (Bengio et al. 2015,
  arXiv:1506.03099; AoANet §3.4: +0.05 every 5 epochs; cap 0.5 from the authors' code).

:func:`build_schedules` gathers a run's four from its :class:`~captioner.models.training.config.TrainConfig` into
:class:`Schedules`.  Label smoothing is a constant of the loss (:func:`captioner.models.training.xe.xe_loss`), not a
schedule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from .config import TrainConfig


@dataclass(frozen=True)
class StepDecay:
    """Piecewise-constant rate of 0-based ``epoch``."""

    lr: float
    factor: float = 1.0
    every: int = 0  # 0: no periodic decay
    start: int = 0  # first epoch counted by the periodic decay
    milestones: tuple[int, ...] = ()  # decay once after each of these many epochs
    milestone_factor: float = 0.1

    def __call__(self, epoch: int) -> float:
        periodic = (epoch - self.start) // self.every if self.every and epoch >= self.start else 0
        drops = sum(epoch >= m for m in self.milestones)
        return self.lr * self.factor ** periodic * self.milestone_factor ** drops


@dataclass(frozen=True)
class NoamWarmup:
    """Rate of 1-based optimiser step ``step``: linear warm-up for ``warmup`` steps, then ``∝ step^{-1/2}``.
    The peak, at ``step = warmup``, is ``factor / sqrt(dim · warmup)``."""

    dim: int
    warmup: int
    factor: float = 1.0

    def __call__(self, step: int) -> float:
        step = max(step, 1)
        return self.factor * self.dim ** -0.5 * min(step ** -0.5, step * self.warmup ** -1.5)


@dataclass
class PlateauDecay:
    """Reduce-on-plateau for a score to maximise: after ``patience`` validations in a row without a gain of more
    than ``threshold`` over the best so far, the scale is multiplied by ``factor`` and the count restarts.
    ``scale`` multiplies the base rate; the state round-trips through :meth:`state_dict` (JSON) for resume."""

    factor: float = 0.5
    patience: int = 3
    threshold: float = 0.0
    min_scale: float = 0.0
    best: float = -math.inf
    bad_checks: int = 0
    scale: float = 1.0

    def update(self, score: float) -> float:
        """Record one validation score; returns the (possibly reduced) scale."""
        if score > self.best + self.threshold:
            self.best, self.bad_checks = score, 0
        else:
            self.bad_checks += 1
            if self.bad_checks >= self.patience:
                self.scale = max(self.scale * self.factor, self.min_scale)
                self.bad_checks = 0
        return self.scale

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best if math.isfinite(self.best) else None, "bad_checks": self.bad_checks,
                "scale": self.scale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best = -math.inf if state.get("best") is None else state["best"]
        self.bad_checks, self.scale = state["bad_checks"], state["scale"]


@dataclass(frozen=True)
class ScheduledSampling:
    """Probability of feeding the model's own sample instead of the ground-truth word, for 0-based ``epoch``."""

    increase: float = 0.0  # 0: off
    every: int = 5
    start: int = 0
    cap: float = 0.5

    def __call__(self, epoch: int) -> float:
        if not self.increase or epoch < self.start:
            return 0.0
        return min(self.cap, self.increase * ((epoch - self.start) // max(self.every, 1)))


@dataclass
class Schedules:
    """The schedules of one run, built from its config by :func:`build_schedules`."""

    epoch_rate: StepDecay
    warmup: NoamWarmup | None = None
    plateau: PlateauDecay | None = None
    sampling: ScheduledSampling = field(default_factory=ScheduledSampling)

    def learning_rate(self, epoch: int, global_step: int) -> float:
        """The rate of optimiser step ``global_step + 1`` in 0-based ``epoch``: Noam when there is a warm-up,
        else the epoch schedule; times the plateau scale."""
        rate = self.warmup(global_step + 1) if self.warmup else self.epoch_rate(epoch)
        return rate * (self.plateau.scale if self.plateau else 1.0)


def build_schedules(cfg: TrainConfig) -> Schedules:
    epoch_rate = StepDecay(cfg.lr, cfg.lr_decay_factor, cfg.lr_decay_every, cfg.lr_decay_start,
                           tuple(cfg.lr_drops), cfg.lr_drop_factor)
    warmup = NoamWarmup(cfg.noam_dim, cfg.warmup_steps, cfg.noam_factor) if cfg.warmup_steps else None
    plateau = PlateauDecay(cfg.plateau_factor, cfg.plateau_patience) if cfg.plateau_factor else None
    sampling = ScheduledSampling(cfg.ss_increase, cfg.ss_every, cfg.ss_start, cfg.ss_max)
    return Schedules(epoch_rate, warmup, plateau, sampling)


def learning_rate(cfg: TrainConfig, epoch: int, global_step: int = 0) -> float:
    """The rate of 0-based ``epoch`` (and step, under Noam), before any plateau decay."""
    return replace(build_schedules(cfg), plateau=None).learning_rate(epoch, global_step)
