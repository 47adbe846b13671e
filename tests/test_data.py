"""Data handling: float targets and their losses (against PyTorch), HDF5 file lists,
transforms, the background thread, partial batches and errors for bad data."""

from __future__ import annotations

import gc
import threading

import h5py
import numpy as np
import pytest
from helpers import WeightedSumLoss, softmax_xent

from latte import Net, Phase
from latte.check import check
from latte.errors import DataError, ShapeError
from latte.solvers import SGD, LRPolicy, SolverParameters, solve
from latte.stdlib import (
    AccuracyLayer,
    ArrayDataLayer,
    EuclideanLossLayer,
    FullyConnectedLayer,
    HDF5DataLayer,
    MemoryDataLayer,
    Mirror,
    Normalize,
    RandomCrop,
    SigmoidCrossEntropyLossLayer,
    SoftmaxLossLayer,
    Transform,
)

LOSSES = {"euclidean": EuclideanLossLayer, "sigmoid_xent": SigmoidCrossEntropyLossLayer}


def _torch_loss(kind: str, x, t, n: int):
    torch = pytest.importorskip("torch")
    if kind == "euclidean":
        return torch.nn.MSELoss(reduction="sum")(x, t) / (2 * n)
    return torch.nn.BCEWithLogitsLoss(reduction="sum")(x, t) / n


def _targets(kind: str, rng, shape) -> np.ndarray:
    t = rng.random(shape) if kind == "sigmoid_xent" else rng.standard_normal(shape)
    return t.astype(np.float32)


@pytest.mark.parametrize("kind", sorted(LOSSES))
@pytest.mark.parametrize("read", [False, True])
def test_target_loss_matches_torch(kind, read):
    """Loss, input gradient and target gradient against torch in float64, logits far
    from zero included (the sigmoid cross-entropy must stay finite and exact there).
    ``read``: a second loss ``sum(w * per-item loss)`` reads the loss's values."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    net = Net(5, seed=0, opt_level=0)
    x = MemoryDataLayer(net, "x", (2, 3))
    t = MemoryDataLayer(net, "t", (2, 3))
    loss = LOSSES[kind]("loss", net, x, t)
    w = WeightedSumLoss(net, "reader", loss).w if read else np.zeros((5, 1), np.float32)
    xv = (4 * rng.standard_normal((5, 2, 3))).astype(np.float32)
    xv[0, 0, 0], xv[1, 1, 2] = 60.0, -80.0
    tv = _targets(kind, rng, (5, 2, 3))
    net.value(x)[...], net.value(t)[...] = xv, tv
    net.forward()
    net.backward()
    tx = torch.tensor(xv, dtype=torch.float64, requires_grad=True)
    tt = torch.tensor(tv, dtype=torch.float64, requires_grad=True)
    want = _torch_loss(kind, tx, tt, 5)
    items = [_torch_loss(kind, tx[i], tt[i], 1) for i in range(5)]
    want = want + sum(float(w[i, 0]) * items[i] for i in range(5))
    want.backward()
    assert np.isfinite(net.loss)
    assert net.loss == pytest.approx(want.item(), rel=1e-6)
    np.testing.assert_allclose(net.grad(x), tx.grad.numpy(), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(net.grad(t), tt.grad.numpy(), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("kind", sorted(LOSSES))
@pytest.mark.parametrize("opt_level", [0, 3])
def test_float_targets_through_a_net_and_a_partial_batch(kind, opt_level):
    """``(N, 2, 2)`` float targets give a ``(2, 2)`` target ensemble; the third batch of 10
    samples at batch 4 (no shuffling) has 2 real items, and the loss, the input gradient
    and the weight gradients are torch's over those two."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(2)
    X = rng.standard_normal((10, 3)).astype(np.float32)
    Y = _targets(kind, rng, (10, 2, 2))
    net = Net(4, seed=0, opt_level=opt_level)
    data, target = ArrayDataLayer(net, (X, Y), shuffle=False)
    assert target.shape == (2, 2)
    fc = FullyConnectedLayer("fc", net, data, 4)
    LOSSES[kind]("loss", net, fc, target)
    net.init()
    for p in net.params:
        p.value[...] = rng.standard_normal(p.value.shape)
    for _ in range(3):
        net.forward()
        net.backward()
    assert net.valid == 2
    np.testing.assert_array_equal(net.value(target)[:2], Y[8:])
    w, b = (torch.tensor(p.value.astype(np.float64), requires_grad=True) for p in net.params)
    out = torch.tensor(X[8:], dtype=torch.float64) @ w.T + b.reshape(-1)
    want = _torch_loss(kind, out, torch.tensor(Y[8:].reshape(2, 4), dtype=torch.float64), 2)
    want.backward()
    assert net.loss == pytest.approx(want.item(), rel=1e-5)
    for p, g in zip(net.params, (w.grad, b.grad)):
        np.testing.assert_allclose(p.grad.reshape(-1), g.numpy().reshape(-1), rtol=1e-4,
                                   atol=1e-6, err_msg=p.name)


def test_losses_reject_bad_targets():
    net = Net(2)
    x = MemoryDataLayer(net, "x", (3,))
    with pytest.raises(ShapeError, match="'loss'.*differ in size"):
        EuclideanLossLayer("loss", net, x, MemoryDataLayer(net, "t", (4,)))
    X = np.zeros((6, 3), np.float32)
    Y = np.full((6, 3), 0.5, np.float32)
    Y[4, 2] = 1.5
    data, target = ArrayDataLayer(net, (X[:4], Y[:4]), test=(X, Y))
    with pytest.raises(DataError, match=r"'bce'.*test y, sample 4: label 1.5 is not in \[0, 1\]"):
        SigmoidCrossEntropyLossLayer("bce", net, data, target)
    t = MemoryDataLayer(net, "t2", (3,))
    SigmoidCrossEntropyLossLayer("fed", net, x, t)
    net.value(t)[...] = -0.25
    with pytest.raises(ShapeError, match="'fed'.*target -0.25 of batch item 0"):
        net.forward()


# ------------------------------------------------------------------ epochs and batches

def _samples_seen(net, data, phase=Phase.TRAIN, batches=None) -> list[float]:
    """The first feature of every real item the next ``batches`` batches hold."""
    source = data.source
    seen = []
    for _ in range(batches or source.batches_per_epoch(phase)):
        net.forward(phase)
        seen += list(net.value(data)[:net.valid, 0])
    return seen


def _fc_net(X, y, batch=4, test=None, shuffle=False, **kwargs):
    net = Net(batch, seed=5, opt_level=0)
    data, label = ArrayDataLayer(net, (X, y), test=test, shuffle=shuffle, **kwargs)
    fc = FullyConnectedLayer("fc", net, data, 3)
    SoftmaxLossLayer("loss", net, fc, label)
    return net, data, label


def test_without_shuffling_every_sample_is_trained_on():
    X = np.arange(10, dtype=np.float32).reshape(10, 1).repeat(2, axis=1)
    y = np.arange(10) % 3
    net, data, _ = _fc_net(X, y)
    assert data.source.batches_per_epoch(Phase.TRAIN) == 3
    for _ in range(2):   # every epoch, in order, the last batch partial
        assert _samples_seen(net, data) == list(range(10))
    history = solve(SGD(SolverParameters(LRPolicy.Fixed(0.1), max_epoch=2)), _fc_net(X, y)[0])
    assert len(history.train_loss) == 6


def test_shuffled_epochs_are_full_batches_of_distinct_samples():
    X = np.arange(10, dtype=np.float32).reshape(10, 1)
    net, data, _ = _fc_net(X, np.zeros(10), shuffle=True)
    epochs = [_samples_seen(net, data) for _ in range(3)]
    assert all(len(e) == 8 and len(set(e)) == 8 for e in epochs)
    assert len({tuple(e) for e in epochs}) == 3   # reshuffled every epoch


def test_partial_batch_gradient_is_that_of_its_real_items():
    """Batch 4 over 10 samples: the third batch's gradients equal a batch-2 net's over the
    two real samples (the wrapped-around padding items count for nothing)."""
    rng = np.random.default_rng(3)
    X = rng.standard_normal((10, 3)).astype(np.float32)
    y = rng.integers(0, 3, 10)
    net, _, _ = _fc_net(X, y)
    small = Net(2, seed=5, opt_level=0)
    x2, y2 = MemoryDataLayer(small, "x", (3,)), MemoryDataLayer(small, "y", (1,))
    SoftmaxLossLayer("loss", small, FullyConnectedLayer("fc", small, x2, 3), y2)
    net.init()
    small.init()
    small.value(x2)[...], small.value(y2)[:, 0] = X[8:], y[8:]
    for p, q in zip(net.params, small.params, strict=True):
        assert p.name == q.name
        p.value[...] = rng.standard_normal(p.value.shape)
        q.value[...] = p.value
    for _ in range(3):
        net.forward()
    small.forward()
    net.backward()
    small.backward()
    logits = X[8:] @ net.params[0].value.T + net.params[1].value.reshape(-1)
    assert net.loss == pytest.approx(softmax_xent(logits, y[8:])[0], rel=1e-5)
    assert net.loss == pytest.approx(small.loss, rel=1e-6)
    for p, q in zip(net.params, small.params):
        np.testing.assert_allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7, err_msg=p.name)


# ------------------------------------------------------------------ HDF5

def _write(path, x, y):
    with h5py.File(path, "w") as f:
        f["data"], f["label"] = x, y
    return path


def test_hdf5_file_list_with_caffe_labels_equals_the_arrays(tmp_path):
    """Two files with ``(N, 1)`` labels, shuffled: the same batches as one array (the array
    gathered straight into the data buffer, the files read ahead on a thread)."""
    rng = np.random.default_rng(4)
    X = rng.standard_normal((11, 2, 3)).astype(np.float32)
    y = rng.integers(0, 3, 11)
    files = [_write(tmp_path / "a.h5", X[:6], y[:6, None].astype(np.float32)),
             _write(tmp_path / "b.h5", X[6:], y[6:, None].astype(np.float32))]
    nets = [_fc_net(X, y, shuffle=True)]
    h5 = Net(4, seed=5, opt_level=0)
    data, label = HDF5DataLayer(h5, files, test_path=[files[1]], shuffle=True)
    assert label.shape == (1,)
    fc = FullyConnectedLayer("fc", h5, data, 3)
    SoftmaxLossLayer("loss", h5, fc, label)
    nets.append((h5, data, label))
    for _ in range(7):   # three epochs of two batches, reshuffled
        for net, _, _ in nets:
            net.forward()
        np.testing.assert_array_equal(nets[0][0].value(nets[0][1]), h5.value(data))
        np.testing.assert_array_equal(nets[0][0].value(nets[0][2]), h5.value(label))
        assert set(h5.value(label)[:, 0]) <= {0.0, 1.0, 2.0}
    assert nets[0][1].source._pool is None and data.source._pool is not None
    h5.forward(Phase.TEST)
    np.testing.assert_array_equal(h5.value(data), X[6:10])


def test_hdf5_float_targets(tmp_path):
    rng = np.random.default_rng(11)
    X, Y = rng.standard_normal((5, 3)).astype(np.float32), rng.random((5, 2, 2))
    net = Net(5, seed=0)
    data, target = HDF5DataLayer(net, _write(tmp_path / "t.h5", X, Y), shuffle=False)
    assert target.shape == (2, 2)
    EuclideanLossLayer("loss", net, FullyConnectedLayer("fc", net, data, 4), target)
    net.forward()
    np.testing.assert_array_equal(net.value(target), Y.astype(np.float32))


def test_hdf5_errors_name_the_file_and_sample(tmp_path):
    X = np.zeros((6, 3), np.float32)
    X[4, 1] = np.inf
    a = _write(tmp_path / "a.h5", X[:3], np.zeros(3))
    b = _write(tmp_path / "b.h5", X[3:], np.zeros(3))
    net = Net(3, seed=0)
    data, label = HDF5DataLayer(net, [a, b], shuffle=False)
    SoftmaxLossLayer("loss", net, FullyConnectedLayer("fc", net, data, 2), label)
    net.forward()
    with pytest.raises(DataError, match=r"b.h5 /data, sample 1: a value is not finite"):
        net.forward()
    c = _write(tmp_path / "c.h5", np.zeros((3, 4), np.float32), np.zeros(3))
    with pytest.raises(DataError, match=r"c.h5.*/data has samples of shape \(4,\)"):
        HDF5DataLayer(Net(3), [a, c])
    d = _write(tmp_path / "d.h5", np.zeros((3, 3), np.float32), np.array([0, 5, 1]))
    net = Net(3)
    data, label = HDF5DataLayer(net, a, test_path=d)
    with pytest.raises(DataError, match=r"'acc'.*d.h5 /label, sample 1: label 5 is not a class"):
        AccuracyLayer("acc", net, FullyConnectedLayer("fc", net, data, 4), label)


# ------------------------------------------------------------------ errors for bad data

def test_non_finite_data_is_named_before_training():
    X = np.zeros((8, 2, 2), np.float32)
    X[5, 1, 0] = np.nan
    with pytest.raises(DataError, match=r"ArrayDataLayer train X, sample 5: .*not finite"):
        ArrayDataLayer(Net(2), (X, np.zeros(8)))
    Xt = np.zeros((3, 2, 2), np.float32)
    Xt[2, 0, 0] = -np.inf
    with pytest.raises(DataError, match=r"ArrayDataLayer test X, sample 2"):
        ArrayDataLayer(Net(2), (np.zeros((8, 2, 2), np.float32), np.zeros(8)), test=(Xt, np.zeros(3)))
    Y = np.zeros((8, 3), np.float32)
    Y[7, 2] = np.nan
    with pytest.raises(DataError, match=r"ArrayDataLayer train y, sample 7"):
        ArrayDataLayer(Net(2), (np.zeros((8, 2), np.float32), Y))


@pytest.mark.parametrize("bad, where", [(7, "train y, sample 3"), (-1, "train y, sample 3"),
                                        (1.5, "train y, sample 3")])
def test_labels_outside_the_classes_are_named_when_the_loss_is_built(bad, where):
    y = np.array([0, 1, 2, 0, 1, 2], np.float64)
    y[3] = bad
    net = Net(2)
    data, label = ArrayDataLayer(net, (np.zeros((6, 2), np.float32), y))
    with pytest.raises(DataError, match=rf"loss 'loss': ArrayDataLayer {where}: label .* "
                                        r"is not a class index in \[0, 3\)"):
        SoftmaxLossLayer("loss", net, FullyConnectedLayer("fc", net, data, 3), label)


def test_bad_values_past_the_first_chunk_are_found():
    """Whole-set checks go a chunk of samples at a time: the index is the set's."""
    X = np.zeros((9000, 2), np.float32)
    y = np.zeros(9000)
    y[8500] = 4
    X[5000, 1] = np.nan
    with pytest.raises(DataError, match=r"train X, sample 5000:"):
        ArrayDataLayer(Net(2), (X, y))
    X[5000, 1] = 0.0
    net = Net(2)
    data, label = ArrayDataLayer(net, (X, y))
    with pytest.raises(DataError, match=r"train y, sample 8500: label 4 "):
        AccuracyLayer("acc", net, data, label)


def test_test_labels_outside_the_classes_are_named_before_training():
    net = Net(2)
    y = np.zeros(4)
    data, label = ArrayDataLayer(net, (np.zeros((4, 2), np.float32), y),
                                 test=(np.zeros((4, 2), np.float32), np.array([0, 1, 2, 3])))
    with pytest.raises(DataError, match=r"test y, sample 3: label 3 is not a class index in \[0, 3\)"):
        SoftmaxLossLayer("loss", net, FullyConnectedLayer("fc", net, data, 3), label)


def test_test_targets_of_another_shape():
    x = np.zeros((4, 3), np.float32)
    with pytest.raises(ShapeError, match=r"test labels have shape \(2,\), train labels \(3,\)"):
        ArrayDataLayer(Net(2), (x, np.zeros((4, 3))), test=(x, np.zeros((4, 2))))


# ------------------------------------------------------------------ transforms

def _crop_reference(x, size, pad, oy, ox):
    padded = np.pad(x, [(0, 0), (0, 0), (pad, pad), (pad, pad)])
    return np.stack([padded[i, :, oy[i]:oy[i] + size[0], ox[i]:ox[i] + size[1]]
                     for i in range(len(x))])


def test_transform_steps_match_numpy_references():
    rng = np.random.default_rng(6)
    x = rng.standard_normal((7, 3, 5, 6)).astype(np.float32)
    mean, std = np.array([0.5, -1.0, 2.0]), np.array([2.0, 0.5, 1.0])
    normed = (x - mean[:, None, None]) / std[:, None, None]
    np.testing.assert_allclose(Normalize(mean, std)(x, None), normed, rtol=1e-6)
    crop = RandomCrop((4, 5), pad=2)
    assert crop.shape((3, 5, 6)) == (3, 4, 5)
    draws = np.random.default_rng(9)
    oy, ox = draws.integers(0, 9 - 4 + 1, 7), draws.integers(0, 10 - 5 + 1, 7)
    assert len(set(zip(oy, ox))) > 1
    np.testing.assert_array_equal(crop(x, np.random.default_rng(9)), _crop_reference(x, (4, 5), 2, oy, ox))
    np.testing.assert_array_equal(crop(x, None), _crop_reference(x, (4, 5), 2, [2] * 7, [2] * 7))
    flip = np.random.default_rng(3).random(7) < 0.5
    assert 0 < flip.sum() < 7
    want = np.where(flip[:, None, None, None], x[..., ::-1], x)
    np.testing.assert_array_equal(Mirror()(x, np.random.default_rng(3)), want)
    np.testing.assert_array_equal(Mirror()(x, None), x)
    whole = Transform(Normalize(mean, std), RandomCrop(4, pad=1), Mirror())
    assert whole.shape((3, 5, 6)) == (3, 4, 4)
    with pytest.raises(ShapeError, match="2 values.*3 channels"):
        Transform(Normalize([0.0, 1.0])).shape((3, 5, 6))
    with pytest.raises(ShapeError, match="does not fit"):
        RandomCrop(8, pad=1).shape((3, 5, 6))


def _augmented_net(X, y, prefetch: bool, batch: int = 4):
    net = Net(batch, seed=7, opt_level=0)
    transform = Transform(Normalize([1.0, -1.0], [2.0, 4.0]), RandomCrop(4, pad=1), Mirror())
    data, label = ArrayDataLayer(net, (X, y), test=(X[:5], y[:5]), transform=transform,
                                 prefetch=prefetch)
    SoftmaxLossLayer("loss", net, FullyConnectedLayer("fc", net, data, 3), label)
    return net, data, label


def test_transformed_batches_are_crops_and_mirrors_and_test_is_centred():
    rng = np.random.default_rng(8)
    X = rng.standard_normal((12, 2, 4, 4)).astype(np.float32)
    y = np.arange(12) % 3
    net, data, label = _augmented_net(X, y, prefetch=True)
    assert data.shape == (2, 4, 4)
    normed = (X - np.array([1.0, -1.0])[:, None, None]) / np.array([2.0, 4.0])[:, None, None]
    # every sample's possible outputs: 9 offsets of the padded sample, mirrored or not
    windows = {}
    for i in range(12):
        outs = [_crop_reference(normed[i:i + 1], (4, 4), 1, [oy], [ox])[0]
                for oy in range(3) for ox in range(3)]
        windows[i] = outs + [o[..., ::-1] for o in outs]
    used = set()
    for _ in range(9):
        net.forward()
        for x, k in zip(net.value(data), net.value(label)[:, 0]):
            matches = [j for i in range(12) if y[i] == k for j, w in enumerate(windows[i])
                       if np.allclose(x, w, rtol=0, atol=1e-6)]
            assert matches, "a training sample is no crop or mirror of any sample"
            used.update(matches)
    assert len(used) > 6   # the draws vary the offsets and the flips
    net.forward(Phase.TEST)
    np.testing.assert_allclose(net.value(data)[:4], normed[:4], rtol=0, atol=1e-6)


def test_background_thread_gives_the_same_batches_and_ends():
    """With and without the thread: the same batches (shuffled, transformed) in the same
    order, test passes in between; ``close`` and collecting the net end the thread."""
    rng = np.random.default_rng(9)
    X = rng.standard_normal((10, 2, 4, 4)).astype(np.float32)
    y = np.arange(10) % 3
    nets = [_augmented_net(X, y, prefetch) for prefetch in (True, False)]
    for step in range(8):   # every third step a whole test pass (2 batches) after training
        for k, phase in enumerate([Phase.TRAIN] + [Phase.TEST] * (2 if step % 3 == 2 else 0)):
            if k == 1:
                for _, data, _ in nets:
                    data.source.reset(Phase.TEST)
            for net, _, _ in nets:
                net.forward(phase)
            (a, da, la), (b, db, lb) = nets
            np.testing.assert_array_equal(a.value(da), b.value(db))
            np.testing.assert_array_equal(a.value(la), b.value(lb))
            assert a.valid == b.valid

    def threads():
        return {t for t in threading.enumerate() if t.name.startswith("latte-data-")}
    gc.collect()   # other tests' nets (a net and its data layers form a cycle)
    mine = threads()
    # the source's own thread: a collected net's may still be ending (told to, not waited for)
    ours = set(nets[0][1].source._pool._threads)
    nets[0][1].source.close()
    assert len(ours) == 1 and ours <= mine and not any(t.is_alive() for t in ours)
    built = _augmented_net(X, y, prefetch=True)
    built[0].forward()
    new = threads() - mine
    assert len(new) == 1
    del built
    gc.collect()
    for t in new:
        t.join(10)   # told to end: it finishes at once, having nothing to do
        assert not t.is_alive()


def _regression(opt_level: int, **kwargs) -> Net:
    """Float targets from a data layer, both target losses, a sigmoid between."""
    rng = np.random.default_rng(10)
    X = rng.standard_normal((6, 5)).astype(np.float32)
    net = Net(3, opt_level=opt_level, seed=1, **kwargs)
    data, target = ArrayDataLayer(net, (X, rng.random((6, 4)).astype(np.float32)))
    fc = FullyConnectedLayer("fc", net, data, 4)
    EuclideanLossLayer("l2", net, fc, target)
    SigmoidCrossEntropyLossLayer("bce", net, FullyConnectedLayer("fc2", net, fc, 4), target)
    return net


def test_latte_check_passes_on_target_losses():
    """``latte check``: level 3 against level 0, level 0 against finite differences."""
    report = check(_regression(3), _regression(0, profile=True))
    assert report.rows and not report.failed(), report.format()
