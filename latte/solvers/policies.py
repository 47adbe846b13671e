"""Learning-rate and momentum schedules, as in Caffe and the original Latte."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable


class LRPolicy:
    """Learning-rate schedules: ``policy(iteration) -> lr``."""

    @dataclass(frozen=True)
    class Fixed:
        lr: float

        def __call__(self, it: int) -> float:
            return self.lr

    @dataclass(frozen=True)
    class Step:
        lr: float
        gamma: float
        stepsize: int

        def __call__(self, it: int) -> float:
            return self.lr * self.gamma ** (it // self.stepsize)

    @dataclass(frozen=True)
    class Exp:
        lr: float
        gamma: float

        def __call__(self, it: int) -> float:
            return self.lr * self.gamma ** it

    @dataclass(frozen=True)
    class Inv:
        lr: float
        gamma: float
        power: float

        def __call__(self, it: int) -> float:
            return self.lr * (1.0 + self.gamma * it) ** (-self.power)

    @dataclass(frozen=True)
    class Decay:
        lr: float
        decay: float

        def __call__(self, it: int) -> float:
            return self.lr / (1.0 + self.decay * it)

    @dataclass(frozen=True)
    class Poly:
        lr: float
        max_iter: int
        power: float

        def __call__(self, it: int) -> float:
            return self.lr * max(0.0, 1.0 - it / self.max_iter) ** self.power

    @dataclass(frozen=True)
    class MultiStep:
        """``lr * gamma**k``, ``k`` the number of milestones ``<= it``."""

        lr: float
        gamma: float
        milestones: tuple[int, ...]

        def __call__(self, it: int) -> float:
            return self.lr * self.gamma ** sum(1 for m in self.milestones if m <= it)

    @dataclass(frozen=True)
    class Cosine:
        """From ``lr`` down to ``min_lr`` along half a cosine over ``max_iter`` iterations,
        then ``min_lr``."""

        lr: float
        max_iter: int
        min_lr: float = 0.0

        def __call__(self, it: int) -> float:
            t = min(it, self.max_iter) / self.max_iter
            return self.min_lr + (self.lr - self.min_lr) * (1.0 + math.cos(math.pi * t)) / 2.0

    @dataclass(frozen=True)
    class Warmup:
        """``policy``'s rate times ``min(1, (it + 1) / warmup_iter)``."""

        policy: Callable[[int], float]
        warmup_iter: int

        def __call__(self, it: int) -> float:
            return self.policy(it) * min(1.0, (it + 1) / self.warmup_iter)


class MomPolicy:
    """Momentum schedules: ``policy(iteration) -> momentum``."""

    @dataclass(frozen=True)
    class Fixed:
        mom: float

        def __call__(self, it: int) -> float:
            return self.mom

    @dataclass(frozen=True)
    class Step:
        mom: float
        gamma: float
        stepsize: int
        max: float

        def __call__(self, it: int) -> float:
            return min(self.max, self.mom * self.gamma ** (it // self.stepsize))

    @dataclass(frozen=True)
    class Linear:
        mom: float
        gamma: float
        stepsize: int
        max: float

        def __call__(self, it: int) -> float:
            return min(self.max, self.mom + self.gamma * (it // self.stepsize))
