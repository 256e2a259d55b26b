"""Learning-rate schedules as pure functions of the step (so resuming needs only the step)."""

from __future__ import annotations

import math

from llmtrain.config import TrainConfig


def lr_at(t: TrainConfig, step: int) -> float:
    """LR for optimizer step `step` (0-based): linear warmup, then cosine, WSD or inverse sqrt.

    cosine: from the step after warmup's last (which reaches lr), decays to min_lr_ratio·lr at
    the last step (max_steps − 1), as wsd's decay does. wsd: constant, then the last
    decay_fraction of the steps decay linearly to min_lr_ratio·lr. inv_sqrt: lr·sqrt(w/step)
    after warmup w (Vaswani et al.), floored at min_lr_ratio·lr.
    """
    peak, floor = t.lr, t.lr * t.min_lr_ratio
    w = t.warmup_steps
    if w and step < w:
        return peak * (step + 1) / w
    if t.schedule == "cosine":
        top = w - 1 if w else 0  # the step at peak: warmup's last, or the first
        prog = min(1.0, (step - top) / max(1, t.max_steps - 1 - top))
        return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * prog))
    if t.schedule == "wsd":
        decay_steps = max(1, int(round(t.decay_fraction * t.max_steps)))
        start = t.max_steps - decay_steps
        if step < start:
            return peak
        return peak - (peak - floor) * min(1.0, (step - start + 1) / decay_steps)
    return max(floor, peak * math.sqrt(max(w, 1) / (step + 1)))
