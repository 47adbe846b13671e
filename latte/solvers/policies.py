"""Learning-rate and momentum schedules, as in Caffe and the original Latte."""

from __future__ import annotations

from dataclasses import dataclass


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
