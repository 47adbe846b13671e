"""The solvers: each is an update rule, compiled into one loop per parameter
(:mod:`latte.compiler.update`), and the per-step scalars it needs.

In every rule ``g`` is the gradient after clipping plus the L2 term
(``grad * clip + regu_coef * decay_mult * param``) and ``k.lr`` is ``lr * lr_mult``. Where a
momentum meets a changing rate, the rate multiplies the gradient as it enters the
history (Caffe's form); with a fixed rate every rule equals ``torch.optim``'s algorithm of
the same name.
"""

from __future__ import annotations

import math

from latte.compiler.update import UpdateRule, sqrt


def _sgd(p, g, s, k):
    h = k.mom * s.history + k.lr * g
    return {"history": h, "param": p - h}


def _nesterov(p, g, s, k):
    # Caffe's Nesterov step: equals torch's (p -= lr * (g + mom * buf)) at a fixed rate
    h = k.mom * s.history + k.lr * g
    return {"history": h, "param": p - ((1.0 + k.mom) * h - k.mom * s.history)}


def _adam(p, g, s, k):
    m = k.beta1 * s.exp_avg + k.one_minus_beta1 * g
    v = k.beta2 * s.exp_avg_sq + k.one_minus_beta2 * g * g
    return {"exp_avg": m, "exp_avg_sq": v,
            "param": p - k.lr * k.inv_bc1 * m / (sqrt(v) * k.inv_sqrt_bc2 + k.eps)}


def _adamw(p, g, s, k):
    return _adam(p * (1.0 - k.lr * k.weight_decay), g, s, k)


def _rmsprop(p, g, s, k):
    avg = k.alpha * s.square_avg + k.one_minus_alpha * g * g
    buf = k.mom * s.momentum_buffer + k.lr * g / (sqrt(avg) + k.eps)
    return {"square_avg": avg, "momentum_buffer": buf, "param": p - buf}


def _adagrad(p, g, s, k):
    total = s.sum + g * g
    return {"sum": total, "param": p - k.lr * g / (sqrt(total) + k.eps)}


SGD_RULE = UpdateRule("sgd", ("history",), (), _sgd)
NESTEROV_RULE = UpdateRule("nesterov", ("history",), (), _nesterov)
# 1 - beta is a scalar of its own: in float32, 1 - 0.999f is 1.3e-5 off 0.001
_ADAM = ("beta1", "one_minus_beta1", "beta2", "one_minus_beta2", "inv_bc1", "inv_sqrt_bc2", "eps")
ADAM_RULE = UpdateRule("adam", ("exp_avg", "exp_avg_sq"), _ADAM, _adam)
ADAMW_RULE = UpdateRule("adamw", ("exp_avg", "exp_avg_sq"), (*_ADAM, "weight_decay"), _adamw)
RMSPROP_RULE = UpdateRule("rmsprop", ("square_avg", "momentum_buffer"),
                          ("alpha", "one_minus_alpha", "eps"),
                          _rmsprop)
ADAGRAD_RULE = UpdateRule("adagrad", ("sum",), ("eps",), _adagrad)


class Solver:
    """A solver: ``rule`` and the values of its own scalars at an iteration
    (:meth:`scalars`); :meth:`step` runs one compiled update of the net."""

    rule: UpdateRule = SGD_RULE

    def __init__(self, params):
        self.params = params

    def scalars(self, net, iteration: int) -> dict:
        return {}

    def step(self, net, iteration: int) -> None:
        p = self.params
        net.update(p.lr_policy(iteration), p.mom_policy(iteration), p.regu_coef, rule=self.rule,
                   scalars=self.scalars(net, iteration), clip_gradients=p.clip_gradients)


class SGD(Solver):
    """Stochastic gradient descent with momentum (``mom_policy``) and weight decay:
    ``hist = mom * hist + lr * g; param -= hist``. ``nesterov=True``: Caffe's Nesterov
    step ``param -= (1 + mom) * hist - mom * hist_before``."""

    def __init__(self, params, nesterov: bool = False):
        super().__init__(params)
        self.nesterov = nesterov
        self.rule = NESTEROV_RULE if nesterov else SGD_RULE


class Adam(Solver):
    """Adam (torch.optim.Adam): ``m = b1*m + (1-b1)*g; v = b2*v + (1-b2)*g^2;
    param -= lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps)``, ``t`` the step (from 1)."""

    rule = ADAM_RULE

    def __init__(self, params, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8):
        super().__init__(params)
        self.beta1, self.beta2, self.eps = beta1, beta2, eps

    def scalars(self, net, iteration: int) -> dict:
        t = iteration + 1
        b1, b2 = self.beta1, self.beta2
        return {"beta1": b1, "one_minus_beta1": 1.0 - b1, "beta2": b2, "one_minus_beta2": 1.0 - b2,
                "inv_bc1": 1.0 / (1.0 - b1 ** t), "inv_sqrt_bc2": 1.0 / math.sqrt(1.0 - b2 ** t),
                "eps": self.eps}


class AdamW(Adam):
    """AdamW (torch.optim.AdamW): ``param *= 1 - lr * weight_decay * decay_mult`` (with the
    parameter's own rate ``lr * lr_mult``), then Adam's step."""

    rule = ADAMW_RULE

    def __init__(self, params, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8,
                 weight_decay: float = 0.01):
        super().__init__(params, beta1, beta2, eps)
        self.weight_decay = weight_decay

    def scalars(self, net, iteration: int) -> dict:
        return {**super().scalars(net, iteration),
                "weight_decay": [self.weight_decay * p.decay_mult for p in net.params]}


class RMSProp(Solver):
    """RMSProp (torch.optim.RMSprop, not centered): ``a = alpha*a + (1-alpha)*g^2;
    buf = mom*buf + lr * g / (sqrt(a) + eps); param -= buf`` (momentum from ``mom_policy``)."""

    rule = RMSPROP_RULE

    def __init__(self, params, alpha: float = 0.99, eps: float = 1e-8):
        super().__init__(params)
        self.alpha, self.eps = alpha, eps

    def scalars(self, net, iteration: int) -> dict:
        return {"alpha": self.alpha, "one_minus_alpha": 1.0 - self.alpha, "eps": self.eps}


class AdaGrad(Solver):
    """AdaGrad (torch.optim.Adagrad): ``sum += g^2; param -= lr * g / (sqrt(sum) + eps)``."""

    rule = ADAGRAD_RULE

    def __init__(self, params, eps: float = 1e-10):
        super().__init__(params)
        self.eps = eps

    def scalars(self, net, iteration: int) -> dict:
        return {"eps": self.eps}
