"""Solvers, rate policies and gradient clipping against ``torch.optim``.

Each step, latte computes the gradients (forward and backward of a small conv + FC net),
and the same float32 gradients are given to ``torch.optim`` running on float64 copies of
the parameters; the parameters are compared after every one of 20 steps. Feeding latte's
own gradients is what makes 1e-5 achievable: the update alone is under test (the layers
have their own tests against torch), and the two trajectories then differ by the update's
float32 rounding only. Letting torch compute its own gradients would mix in the float32
error of forward and backward (about 1e-6 relative), which Adam's ``g / sqrt(v)`` and
RMSProp's turn into differences of order one for entries whose gradient is near zero.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_scaled_close

from latte import Net
from latte.compiler.update import UpdateRule
from latte.errors import LatteError, TrainingError
from latte.solvers import (
    SGD,
    AdaGrad,
    Adam,
    AdamW,
    LRPolicy,
    MomPolicy,
    RMSProp,
    SolverParameters,
    solve,
)
from latte.stdlib import ArrayDataLayer, ConvolutionLayer, FullyConnectedLayer, ReLULayer, SoftmaxLossLayer

STEPS = 20
RTOL = 1e-5
LR, REGU = 0.05, 0.01


def _net(opt_level: int = 3, threads: int = 1, width: int = 6, seed: int = 0) -> Net:
    """The same data whatever ``seed`` (which draws the initial parameters)."""
    rng = np.random.default_rng(0)
    X = rng.standard_normal((32, 2, 6, 6)).astype(np.float32)
    y = rng.integers(0, 4, 32)
    net = Net(8, num_threads=threads, opt_level=opt_level, seed=seed)
    data, label = ArrayDataLayer(net, (X, y), shuffle=False)
    conv = ReLULayer("relu", net, ConvolutionLayer("conv", net, data, 3, 3, pad=1))
    fc = FullyConnectedLayer("fc", net, conv, width)
    SoftmaxLossLayer("loss", net, FullyConnectedLayer("out", net, fc, 4), label)
    net.init()
    rng = np.random.default_rng(seed)
    for p in net.params:   # biases start at zero: give them values (and gradients) of note
        if p.name.endswith(".bias"):
            p.value[...] = 0.1 * rng.standard_normal(p.value.shape)
    return net


def _torch_twin(torch, net: Net, make_opt, lr: float, regu: float):
    """float64 copies of the parameters, one param group each (Caffe's ``lr_mult`` and
    ``decay_mult`` as group settings), and ``make_opt(groups)``'s optimizer."""
    params = [torch.tensor(p.value, dtype=torch.float64, requires_grad=True) for p in net.params]
    groups = [{"params": [t], "lr": lr * p.lr_mult, "weight_decay": regu * p.decay_mult}
              for t, p in zip(params, net.params)]
    return params, make_opt(groups)


CASES = {
    "sgd": (lambda sp: SGD(sp), lambda t, g: t.optim.SGD(g, momentum=0.9), 0.9),
    "nesterov": (lambda sp: SGD(sp, nesterov=True),
                 lambda t, g: t.optim.SGD(g, momentum=0.9, nesterov=True), 0.9),
    "adam": (lambda sp: Adam(sp, beta1=0.8, beta2=0.99),
             lambda t, g: t.optim.Adam(g, betas=(0.8, 0.99), eps=1e-8), 0.0),
    "rmsprop": (lambda sp: RMSProp(sp), lambda t, g: t.optim.RMSprop(g, alpha=0.99, eps=1e-8), 0.0),
    "rmsprop_momentum": (lambda sp: RMSProp(sp, alpha=0.9),
                         lambda t, g: t.optim.RMSprop(g, alpha=0.9, eps=1e-8, momentum=0.5), 0.5),
    "adagrad": (lambda sp: AdaGrad(sp), lambda t, g: t.optim.Adagrad(g, eps=1e-10), 0.0),
}


def _compare(torch, net: Net, solver, params, opt, sched=None, clip=None, steps=STEPS):
    for it in range(steps):
        net.forward()
        net.backward()
        for t, p in zip(params, net.params):
            t.grad = torch.tensor(p.grad, dtype=torch.float64)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        if sched is not None:
            sched.step()
        solver.step(net, it)
        for t, p in zip(params, net.params):
            assert_scaled_close(p.value, t.detach().numpy(), RTOL, f"{p.name} after step {it + 1}")


@pytest.mark.parametrize("opt_level", [0, 3])
@pytest.mark.parametrize("case", sorted(CASES))
def test_solver_matches_torch(case, opt_level):
    torch = pytest.importorskip("torch")
    make, make_opt, mom = CASES[case]
    net = _net(opt_level)
    lr = 0.01 if case != "sgd" and case != "nesterov" else LR
    params, opt = _torch_twin(torch, net, lambda g: make_opt(torch, g), lr, REGU)
    solver = make(SolverParameters(lr_policy=LRPolicy.Fixed(lr), mom_policy=MomPolicy.Fixed(mom),
                                   regu_coef=REGU))
    _compare(torch, net, solver, params, opt)


@pytest.mark.parametrize("opt_level", [0, 3])
def test_adamw_decoupled_decay_matches_torch(opt_level):
    """AdamW's decay uses the parameter's rate and its ``decay_mult`` (biases: none); the
    L2 term (``regu_coef``) is separate and zero here, as torch's AdamW has none."""
    torch = pytest.importorskip("torch")
    net = _net(opt_level)
    params = [torch.tensor(p.value, dtype=torch.float64, requires_grad=True) for p in net.params]
    opt = torch.optim.AdamW([{"params": [t], "lr": 0.01 * p.lr_mult,
                              "weight_decay": 0.1 * p.decay_mult}
                             for t, p in zip(params, net.params)], eps=1e-8)
    solver = AdamW(SolverParameters(lr_policy=LRPolicy.Fixed(0.01)), weight_decay=0.1)
    _compare(torch, net, solver, params, opt)


POLICIES = {
    "multistep": (LRPolicy.MultiStep(LR, 0.5, (3, 7, 12)),
                  lambda t, o: t.optim.lr_scheduler.MultiStepLR(o, [3, 7, 12], gamma=0.5)),
    # torch's eta_min is one rate for all groups, latte's min_lr is scaled by lr_mult too
    "cosine": (LRPolicy.Cosine(LR, STEPS),
               lambda t, o: t.optim.lr_scheduler.CosineAnnealingLR(o, STEPS)),
    "warmup": (LRPolicy.Warmup(LRPolicy.MultiStep(LR, 0.5, (8, 15)), 5),
               lambda t, o: t.optim.lr_scheduler.ChainedScheduler([
                   t.optim.lr_scheduler.LinearLR(o, 1 / 5, 1.0, total_iters=4),
                   t.optim.lr_scheduler.MultiStepLR(o, [8, 15], gamma=0.5)])),
}


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_policy_matches_torch_scheduler(policy):
    """Rates that change every step, on the solvers where torch's form and Caffe's agree
    (SGD without momentum, Adam)."""
    torch = pytest.importorskip("torch")
    lr_policy, make_sched = POLICIES[policy]
    for solver_type, opt_type in ((SGD, torch.optim.SGD), (Adam, torch.optim.Adam)):
        net = _net()
        params, opt = _torch_twin(torch, net, lambda g: opt_type(g), LR, REGU)   # noqa: B023
        solver = solver_type(SolverParameters(lr_policy=lr_policy, regu_coef=REGU))
        _compare(torch, net, solver, params, opt, make_sched(torch, opt))


def test_policy_values():
    assert [LRPolicy.MultiStep(1.0, 0.1, (2, 4))(i) for i in (0, 1, 2, 3, 4, 9)] == \
        pytest.approx([1, 1, 0.1, 0.1, 0.01, 0.01])
    cos = LRPolicy.Cosine(1.0, 10, min_lr=0.2)
    assert [cos(0), cos(5), cos(10), cos(25)] == pytest.approx([1.0, 0.6, 0.2, 0.2])
    warm = LRPolicy.Warmup(LRPolicy.Fixed(2.0), 4)
    assert [warm(i) for i in range(6)] == pytest.approx([0.5, 1.0, 1.5, 2.0, 2.0, 2.0])


@pytest.mark.parametrize("case", ["sgd", "adam"])
def test_clipping_matches_clip_grad_norm(case):
    """``clip_gradients`` scales the gradients before the L2 term, as ``clip_grad_norm_``
    before an optimizer's ``weight_decay``; the bound is active at every step."""
    torch = pytest.importorskip("torch")
    make, make_opt, mom = CASES[case]
    net = _net()
    net.forward()
    net.backward()
    norm = float(np.sqrt(sum((p.grad.astype(np.float64) ** 2).sum() for p in net.params)))
    assert net.grad_norm() == pytest.approx(norm, rel=1e-6)
    clip = 0.3 * norm
    params, opt = _torch_twin(torch, net, lambda g: make_opt(torch, g), 0.01, REGU)
    solver = make(SolverParameters(lr_policy=LRPolicy.Fixed(0.01), mom_policy=MomPolicy.Fixed(mom),
                                   regu_coef=REGU, clip_gradients=clip))
    _compare(torch, net, solver, params, opt, clip=clip)


def test_momentum_with_changing_rate_is_caffes_form():
    """SGD's rate multiplies the gradient as it enters the history (Caffe), unlike torch's
    SGD, which scales the whole history by the current rate: a float64 reference."""
    net = _net()
    policy = LRPolicy.MultiStep(LR, 0.1, (5, 10))
    mom = MomPolicy.Linear(0.5, 0.1, 4, 0.9)
    solver = SGD(SolverParameters(lr_policy=policy, mom_policy=mom, regu_coef=REGU))
    value = {p.name: p.value.astype(np.float64) for p in net.params}
    hist = {p.name: np.zeros_like(v) for p, v in zip(net.params, value.values())}
    for it in range(STEPS):
        net.forward()
        net.backward()
        for p in net.params:
            g = p.grad + REGU * p.decay_mult * value[p.name]
            hist[p.name] = mom(it) * hist[p.name] + policy(it) * p.lr_mult * g
            value[p.name] -= hist[p.name]
        solver.step(net, it)
        for p in net.params:
            assert_scaled_close(p.value, value[p.name], RTOL, f"{p.name} after step {it + 1}")
            assert_scaled_close(p.history, hist[p.name], RTOL, f"{p.name} history")


@pytest.mark.parametrize("make", [lambda sp: Adam(sp), lambda sp: RMSProp(sp),
                                  lambda sp: SGD(sp, nesterov=True)])
def test_parallel_update_equals_level_0(make):
    """Parameters large enough for the update loops and the norm's partial sums to be split
    over 2 threads (level 3) update as at level 0, given level 0's gradients (the levels'
    gradients differ by float32 rounding, which Adam's first step can blow up where a
    gradient is near ``eps``)."""
    nets = [_net(0, 1, width=2048), _net(3, 2, width=2048)]
    assert max(p.value.size for p in nets[0].params) >= 1 << 15
    sp = SolverParameters(lr_policy=LRPolicy.Fixed(0.01), mom_policy=MomPolicy.Fixed(0.9),
                          regu_coef=REGU, clip_gradients=0.5)
    solvers = [make(sp), make(sp)]
    for it in range(4):
        for net in nets:
            net.forward()
            net.backward()
        for p, q in zip(*(n.params for n in nets)):
            q.grad[...] = p.grad
        for net, solver in zip(nets, solvers):
            solver.step(net, it)
        for p, q in zip(*(n.params for n in nets)):
            assert_scaled_close(q.value, p.value, 1e-6, f"{p.name} after step {it + 1}")


def test_solver_state_saved_and_loaded(tmp_path):
    """Adam's moments go into the snapshot: a net loaded from it takes the same steps."""
    sp = SolverParameters(lr_policy=LRPolicy.Fixed(0.01))
    net, solver = _net(), Adam(sp)

    def steps(net, first):
        for it in range(first, first + 2):
            net.forward()
            net.backward()
            solver.step(net, it)
        return [p.value.copy() for p in net.params]

    steps(net, 0)
    net.save(tmp_path / "snap.npz")
    with np.load(tmp_path / "snap.npz") as data:
        assert {"exp_avg/fc.weights", "exp_avg_sq/fc.weights", "value/fc.weights"} <= set(data)
        assert "history/fc.weights" not in data
    want = steps(net, 2)
    other = _net(seed=1)
    other.load(tmp_path / "snap.npz")   # the data position too: the next batch is the third
    got = steps(other, 2)
    for p, a, b in zip(net.params, got, want):
        np.testing.assert_array_equal(a, b, err_msg=p.name)


def test_old_sgd_snapshot_loads(tmp_path):
    """A snapshot as latte wrote them before other solvers (values, ``history/``) loads,
    and a state the snapshot's solver did not have starts from zero."""
    net = _net()
    arrays = {f"value/{p.name}": np.full(p.value.shape, 0.5, np.float32) for p in net.params}
    arrays |= {f"history/{p.name}": np.full(p.value.shape, 0.25, np.float32) for p in net.params}
    np.savez(tmp_path / "old.npz", __state__=np.array('{"iteration": 3, "epoch": 1}'), **arrays)
    Adam(SolverParameters()).step(net, 0)   # gives the net Adam's moments
    net.load(tmp_path / "old.npz")
    assert net.solver_state == {"iteration": 3, "epoch": 1}
    for p in net.params:
        assert (p.value == 0.5).all() and (p.history == 0.25).all()
        assert not p.state["exp_avg"].any() and not p.state["exp_avg_sq"].any()


def test_non_finite_parameter_stops_training():
    """A NaN weight behind a ReLU leaves the loss finite (max(NaN, 0) is 0), yet training
    stops at once, naming the parameter."""
    net = _net()
    net.params[0].value.reshape(-1)[4] = np.nan
    with pytest.raises(TrainingError, match=r"'conv\.weights'.*iteration 0"):
        solve(SGD(SolverParameters(lr_policy=LRPolicy.Fixed(0.01))), net)
    assert np.isfinite(net.loss)
    net.params[0].value.reshape(-1)[4] = 0.0
    assert net.nonfinite_params() == []
    net.params[2].value[1, 3] = np.inf
    assert net.nonfinite_params() == ["fc.weights"]


def test_bad_arguments():
    with pytest.raises(ValueError, match="clip_gradients"):
        SolverParameters(clip_gradients=0.0)
    rule = UpdateRule("bad", (), (), lambda p, g, s, k: {"param": p, "momentum": g})
    with pytest.raises(ValueError, match="'momentum'"):
        _net().update(0.1, rule=rule)
    with pytest.raises(ValueError, match=r"state names \['value'\] are taken"):
        UpdateRule("clash", ("value",), (), lambda p, g, s, k: {"param": p})


def test_snapshot_of_another_net_is_refused(tmp_path):
    net = _net()
    np.savez(tmp_path / "other.npz", __state__=np.array("{}"),
             **{f"value/{p.name}": p.value for p in net.params if p.name != "fc.weights"})
    with pytest.raises(LatteError, match="has no 'value/fc.weights'"):
        net.load(tmp_path / "other.npz")
    wide = _net(width=7)
    wide.save(tmp_path / "wide.npz")
    with pytest.raises(LatteError, match="'value/fc.weights' has shape"):
        net.load(tmp_path / "wide.npz")


def test_a_net_without_parameters_trains():
    rng = np.random.default_rng(1)
    net = Net(8, seed=0)
    data, label = ArrayDataLayer(net, (rng.standard_normal((32, 4)).astype(np.float32),
                                       rng.integers(0, 4, 32)))
    SoftmaxLossLayer("loss", net, ReLULayer("relu", net, data), label)
    history = solve(Adam(SolverParameters(clip_gradients=1.0)), net)
    assert len(history.train_loss) == 4 and net.params == [] and net.grad_norm() == 0.0
