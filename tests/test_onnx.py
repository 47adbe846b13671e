"""ONNX import (latte.onnx.load_onnx): PyTorch models exported to ONNX run in latte as in
onnxruntime on the same file, at opt levels 0 and 3; hand-built graphs cover the ops
PyTorch does not write (MatMul + Add, constants broadcast per channel, Squeeze) and the
errors; an imported net trains."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from helpers import WeightedSumLoss, assert_scaled_close, fill

from latte import Net
from latte.errors import DataError, ModelImportError
from latte.stdlib import MeanPoolingLayer, MemoryDataLayer, SoftmaxLossLayer

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
torch = pytest.importorskip("torch")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402
from torch import nn  # noqa: E402

from latte.onnx import load_onnx  # noqa: E402

RTOL = 1e-4
BATCH, SAMPLES = 4, 5   # predict runs two batches, the second padded


class LRN(torch.autograd.Function):
    """PyTorch's LocalResponseNorm, exported as ONNX's LRN node (PyTorch writes it as a
    decomposition of pads and average pools otherwise)."""

    @staticmethod
    def forward(ctx, x):
        return nn.functional.local_response_norm(x, 5, 1e-3, 0.75, 2.0)

    @staticmethod
    def symbolic(g, x):
        return g.op("LRN", x, size_i=5, alpha_f=1e-3, beta_f=0.75, bias_f=2.0)


class Lambda(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def mlp() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(48, 32), nn.ReLU(), nn.Linear(32, 24),
                         nn.LeakyReLU(0.1), nn.Linear(24, 16), nn.Tanh(), nn.Dropout(0.3),
                         nn.Linear(16, 12), nn.Sigmoid(), nn.Linear(12, 10))


def lenet() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 6, 5), nn.MaxPool2d(2), nn.Conv2d(6, 16, 5), nn.MaxPool2d(2),
                         Lambda(lambda x: x.view(x.size(0), -1)),   # Shape/Gather/Reshape
                         nn.Linear(16 * 4 * 4, 50), nn.ReLU(), nn.Linear(50, 10),
                         nn.Softmax(dim=1))


def vgg_block() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1),
                         nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(16 * 8 * 8, 10))


class Basic(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)
        self.c2, self.b2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
        self.down = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                     if stride > 1 or cin != cout else nn.Identity())

    def forward(self, x):
        y = torch.relu(self.b1(self.c1(x)))
        return torch.relu(self.b2(self.c2(y)) + self.down(x))


def resnet() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.MaxPool2d(3, 2, 1), Basic(8, 8, 1), Basic(8, 16, 2),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))


class Inception(nn.Module):
    def __init__(self, cin: int):
        super().__init__()
        self.b1 = nn.Sequential(nn.Conv2d(cin, 8, 1), nn.ReLU())
        self.b2 = nn.Sequential(nn.Conv2d(cin, 6, 1), nn.ReLU(), nn.Conv2d(6, 8, 3, padding=1), nn.ReLU())
        self.b3 = nn.Sequential(nn.Conv2d(cin, 4, 1), nn.ReLU(), nn.Conv2d(4, 4, 5, padding=2), nn.ReLU())
        self.b4 = nn.Sequential(nn.MaxPool2d(3, 1, 1), nn.Conv2d(cin, 4, 1), nn.ReLU())
        self.head = nn.Sequential(nn.AvgPool2d(3, 2, 1, count_include_pad=False),
                                  nn.AvgPool2d(2), nn.Flatten(), nn.Linear(24 * 3 * 3, 10))

    def forward(self, x):
        return self.head(torch.cat([self.b1(x), self.b2(x), self.b3(x), self.b4(x)], 1))


def inception() -> nn.Module:
    return Inception(12)


def alexnet() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 16, 5, 2, 2), nn.ReLU(), Lambda(LRN.apply), nn.MaxPool2d(3, 2),
                         nn.Conv2d(16, 24, 3, padding=2, dilation=2, groups=2), nn.ReLU(),
                         Lambda(LRN.apply), nn.MaxPool2d(3, 2),
                         nn.Conv2d(24, 24, 3, padding=1, groups=2), nn.ReLU(), nn.Flatten(),
                         nn.Linear(24 * 3 * 3, 32), nn.ReLU(), nn.Dropout(), nn.Linear(32, 10))


MODELS = {   # name: (model, sample shape, dynamic batch, keep batch norm nodes)
    "mlp": (mlp, (3, 4, 4), True, False),
    "lenet": (lenet, (1, 28, 28), False, False),
    "vgg_block": (vgg_block, (3, 16, 16), True, False),
    "resnet": (resnet, (3, 16, 16), True, True),
    "inception": (inception, (12, 12, 12), True, False),
    "alexnet": (alexnet, (3, 32, 32), True, False),
}


def export(model: nn.Module, sample: tuple, path, *, dynamic: bool, keep_bn: bool = False) -> None:
    """``model`` (eval mode) to ONNX at ``path``: batch 2, the batch dimension symbolic when
    ``dynamic``; PyTorch folds eval batch norm into convolutions unless ``keep_bn``."""
    model.eval()
    dynamic_axes = {"x": {0: "n"}, "y": {0: "n"}} if dynamic else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.randn(2, *sample),), str(path), dynamo=False,
                          input_names=["x"], output_names=["y"], dynamic_axes=dynamic_axes,
                          do_constant_folding=not keep_bn)


def ort_run(path, x: np.ndarray) -> np.ndarray:
    """onnxruntime's outputs for ``x``, run at the file's batch size when it is fixed."""
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    inp = sess.get_inputs()[0]
    step = inp.shape[0] if isinstance(inp.shape[0], int) else len(x)
    assert len(x) % step == 0
    return np.concatenate([sess.run(None, {inp.name: x[i:i + step]})[0] for i in range(0, len(x), step)])


def randomize_bn(model: nn.Module, rng: np.random.Generator) -> None:
    """Running statistics and affine parameters away from their initial values."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                for t, lo, hi in ((m.running_mean, -1, 1), (m.running_var, 0.5, 2),
                                  (m.weight, 0.5, 1.5), (m.bias, -0.5, 0.5)):
                    t.copy_(torch.from_numpy(rng.uniform(lo, hi, t.shape)))


@pytest.mark.parametrize("name", list(MODELS))
def test_pytorch_models_match_onnxruntime(name, tmp_path):
    build, sample, dynamic, keep_bn = MODELS[name]
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    model = build()
    randomize_bn(model, rng)
    path = tmp_path / f"{name}.onnx"
    export(model, sample, path, dynamic=dynamic, keep_bn=keep_bn)
    ops = {n.op_type for n in onnx.load(str(path)).graph.node}
    assert not keep_bn or "BatchNormalization" in ops
    x = rng.standard_normal((SAMPLES + (not dynamic), *sample)).astype(np.float32)
    expected = ort_run(path, x)
    for opt in (0, 3):
        net, inputs, outputs = load_onnx(path, BATCH, opt_level=opt, num_threads=2)
        assert [e.shape for e in inputs] == [sample]
        assert outputs[0].shape == expected.shape[1:]
        assert_scaled_close(net.predict(x, outputs[0]), expected, RTOL, f"{name} at opt {opt}")


def test_imported_parameters_and_state_are_the_models(tmp_path):
    torch.manual_seed(1)
    model = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                          nn.Flatten(), nn.Linear(4 * 5 * 5, 3))
    randomize_bn(model, np.random.default_rng(1))
    export(model, (2, 5, 5), tmp_path / "m.onnx", dynamic=True, keep_bn=True)
    net, _, _ = load_onnx(tmp_path / "m.onnx", 2, opt_level=0)
    net.init()
    params = {p.name: p.value for p in net.params}
    conv, bn, fc = sorted({p.name.rsplit(".", 1)[0] for p in net.params})   # 0_Conv, 1_..., 4_Gemm
    np.testing.assert_array_equal(params[f"{conv}.weights"].reshape(4, 2, 3, 3), model[0].weight.detach())
    np.testing.assert_array_equal(params[f"{bn}.scale"].ravel(), model[1].weight.detach())
    np.testing.assert_array_equal(net.state[f"{bn}.running_var"].ravel(), model[1].running_var)
    np.testing.assert_array_equal(params[f"{fc}.weights"], model[4].weight.detach())
    np.testing.assert_array_equal(params[f"{fc}.bias"].ravel(), model[4].bias.detach())


# ---------------------------------------------------------------- hand-built graphs
def make_model(nodes, inputs, outputs, initializers=(), opset: int = 17):
    """A model at the oldest IR version its opset allows (onnx's newest can be one the
    installed onnxruntime does not read yet)."""
    graph = helper.make_graph(nodes, "g", inputs, outputs,
                              [numpy_helper.from_array(np.asarray(v), k) for k, v in initializers])
    opsets = [helper.make_opsetid("", opset)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=helper.find_min_ir_version_for(opsets))


def value(name: str, shape) -> object:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def test_matmul_add_and_broadcast_constants(tmp_path):
    """MatMul + Add (the bias folds into the fully connected layer), a per-channel Mul, Sub
    and Div by constants, Squeeze, Concat, Identity and a spatial ReduceMean, against
    onnxruntime."""
    rng = np.random.default_rng(2)
    f32 = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    inits = [("w", f32(6, 2, 3, 3)), ("b", f32(6)), ("s", f32(1, 6, 1, 1)), ("m", f32(6, 4, 4)),
             ("d", np.abs(f32(1)) + 0.5), ("fw", f32(96, 8)), ("fb", f32(8)), ("ax", np.array([2, 3]))]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Mul", ["c", "s"], ["c1"]),
             helper.make_node("Sub", ["c1", "m"], ["c2"]),
             helper.make_node("Div", ["c2", "d"], ["c3"]),
             helper.make_node("Concat", ["c3", "c"], ["cat"], axis=1),
             helper.make_node("GlobalAveragePool", ["cat"], ["g"]),
             helper.make_node("Squeeze", ["g", "ax"], ["g1"]),
             helper.make_node("Identity", ["c3"], ["c4"]),
             helper.make_node("Flatten", ["c4"], ["f"]),
             helper.make_node("MatMul", ["f", "fw"], ["mm"]),
             helper.make_node("Add", ["mm", "fb"], ["y"]),
             helper.make_node("Relu", ["g1"], ["z"]),
             helper.make_node("ReduceMean", ["c3"], ["v"], axes=[-2, -1], keepdims=0)]
    path = tmp_path / "g.onnx"
    outputs = [value("y", ["n", 8]), value("z", ["n", 12]), value("v", ["n", 6])]
    onnx.save(make_model(nodes, [value("x", ["n", 2, 4, 4])], outputs, inits), path)
    x = f32(SAMPLES, 2, 4, 4)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    want_y, want_z, want_v = sess.run(None, {"x": x})
    for opt in (0, 3):
        net, _, (y, z, v) = load_onnx(path, BATCH, opt_level=opt)
        assert (z.shape, v.shape) == ((12,), (6,))
        assert_scaled_close(net.predict(x, v), want_v, RTOL, f"v at opt {opt}")
        assert "y" not in {e.name for e in net.ensembles}   # the Add is the MatMul's bias
        assert_scaled_close(net.predict(x, y), want_y, RTOL, f"y at opt {opt}")
        assert_scaled_close(net.predict(x, z), want_z, RTOL, f"z at opt {opt}")


def test_reshapes_that_move_values_between_dimensions(tmp_path):
    """A Reshape that is not only adding or dropping size-1 dimensions ((6, 4, 4) -> (12, 8)),
    read by a layer that needs the new shape (a concat along its last axis) and returned as
    an output, against onnxruntime."""
    rng = np.random.default_rng(6)
    inits = [("w", rng.standard_normal((6, 2, 3, 3)).astype(np.float32)),
             ("s", np.array([0, 12, 8]))]
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Reshape", ["c", "s"], ["r"]),
             helper.make_node("Concat", ["r", "r"], ["y"], axis=-1)]
    path = tmp_path / "r.onnx"
    onnx.save(make_model(nodes, [value("x", ["n", 2, 4, 4])], [value("y", ["n", 12, 16]),
                                                                  value("r", ["n", 12, 8])],
                         inits), path)
    x = rng.standard_normal((SAMPLES, 2, 4, 4)).astype(np.float32)
    want_y, want_r = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    for opt in (0, 3):
        net, _, (y, r) = load_onnx(path, BATCH, opt_level=opt)
        assert (y.shape, r.shape) == ((12, 16), (12, 8))
        assert_scaled_close(net.predict(x, y), want_y, RTOL, f"y at opt {opt}")
        assert_scaled_close(net.predict(x, r), want_r, RTOL, f"r at opt {opt}")


@pytest.mark.parametrize("opt", [0, 3])
def test_more_ops_and_attributes(opt, tmp_path):
    """Gemm with alpha, beta and an untransposed B, PRelu, Elu on the input itself, a padded
    AveragePool counting the padding, GlobalMaxPool, batch norm on a 2-D input, Dropout with
    a ratio input, Reshape to 2-D, Unsqueeze and Softmax at opset 12 (over all axes from
    ``axis`` on), against onnxruntime."""
    rng = np.random.default_rng(4)
    f32 = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    inits = [("slope", np.abs(f32(3, 1, 1))), ("gb", f32(27, 7)), ("gc", f32(1, 7)),
             ("shape", np.array([0, -1])), ("bn_s", f32(7)), ("bn_b", f32(7)), ("bn_m", f32(7)),
             ("bn_v", np.abs(f32(7)) + 0.5), ("ratio", np.array(0.25, np.float32))]
    nodes = [helper.make_node("Elu", ["x"], ["e"], alpha=0.7),
             helper.make_node("PRelu", ["e", "slope"], ["p"]),
             helper.make_node("AveragePool", ["p"], ["a"], kernel_shape=[3, 3], strides=[2, 2],
                              pads=[1, 1, 1, 1], count_include_pad=1),
             helper.make_node("GlobalMaxPool", ["p"], ["gm"]),
             helper.make_node("Reshape", ["a", "shape"], ["r"]),
             helper.make_node("Gemm", ["r", "gb", "gc"], ["g"], alpha=0.5, beta=2.0),
             helper.make_node("BatchNormalization", ["g", "bn_s", "bn_b", "bn_m", "bn_v"], ["b"],
                              epsilon=1e-3),
             helper.make_node("Dropout", ["b", "ratio"], ["d"]),
             helper.make_node("Unsqueeze", ["d"], ["u"], axes=[2]),
             helper.make_node("Softmax", ["u"], ["y"], axis=1),
             helper.make_node("Flatten", ["gm"], ["z"])]
    model = make_model(nodes, [value("x", ["n", 3, 5, 5])], [value("y", ["n", 7, 1]),
                                                               value("z", ["n", 3])], inits, opset=12)
    path = tmp_path / "more.onnx"
    onnx.save(model, path)
    x = f32(SAMPLES, 3, 5, 5)
    want_y, want_z = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    net, _, (y, z) = load_onnx(path, BATCH, opt_level=opt)
    assert (y.shape, z.shape) == ((7, 1), (3,))
    assert_scaled_close(net.predict(x, y), want_y, RTOL, "y")
    assert_scaled_close(net.predict(x, z), want_z, RTOL, "z")


def test_mean_pooling_without_padding_in_the_divisor():
    """MeanPoolingLayer(count_include_pad=False) (what ONNX's AveragePool does by default)
    is PyTorch's AvgPool2d with that option, in forward and input gradient (float64)."""
    rng = np.random.default_rng(5)
    for kernel, stride, pad in ((3, 2, 1), ((2, 3), 1, (1, 1)), (3, 3, 1)):
        for opt in (0, 3):
            net = Net(3, opt_level=opt)
            data = MemoryDataLayer(net, "data", (2, 7, 6))
            pool = MeanPoolingLayer("pool", net, data, kernel, stride, pad, count_include_pad=False)
            loss = WeightedSumLoss(net, "loss", pool)
            x = fill(net, data, rng)
            net.forward()
            net.backward()
            xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
            yt = nn.functional.avg_pool2d(xt, kernel, stride, pad, count_include_pad=False)
            (yt * torch.from_numpy(loss.w.astype(np.float64))).sum().backward()
            what = f"kernel {kernel} stride {stride} pad {pad} opt {opt}"
            assert_scaled_close(net.value(pool), yt.detach().numpy(), RTOL, f"forward, {what}")
            assert_scaled_close(net.grad(data), xt.grad.numpy(), RTOL, f"input gradient, {what}")


@pytest.mark.parametrize("node, inputs, match", [
    (helper.make_node("Erf", ["x"], ["y"], name="my_erf"), [], r"'my_erf' \(Erf\).*unsupported"),
    (helper.make_node("Conv", ["x", "w"], ["y"], name="c", pads=[0, 0, 1, 1]), ["w"],
     r"'c' \(Conv\).*asymmetric pads"),
    (helper.make_node("Reshape", ["x", "s"], ["y"], name="r"), ["s"], r"'r' \(Reshape\).*batch"),
    (helper.make_node("LRN", ["x"], ["y"], name="n", size=4), [], r"'n' \(LRN\).*even size"),
    (helper.make_node("MaxPool", ["x"], ["y"], name="p", kernel_shape=[2, 2], strides=[2, 2],
                      ceil_mode=1), [],
     r"'p' \(MaxPool\).*ceil_mode"),
    (helper.make_node("Add", ["x", "v"], ["y"], name="a"), ["v"], r"'a' \(Add\).*broadcast"),
])
def test_unsupported_is_an_error_naming_the_node(node, inputs, match, tmp_path):
    consts = {"w": np.ones((2, 2, 2, 2), np.float32), "s": np.array([-1, 3], np.int64),
              "v": np.ones((2, 2, 3, 3), np.float32)}
    model = make_model([node], [value("x", ["n", 2, 3, 3])], [value("y", None)],
                       [(k, consts[k]) for k in inputs])
    onnx.save(model, tmp_path / "bad.onnx")
    with pytest.raises(ModelImportError, match=match):
        load_onnx(tmp_path / "bad.onnx", 2)


def test_missing_file_and_bad_input(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_onnx(tmp_path / "none.onnx", 2)
    (tmp_path / "junk.onnx").write_bytes(b"\x00 not a model")
    with pytest.raises(ModelImportError, match="junk.onnx"):
        load_onnx(tmp_path / "junk.onnx", 2)
    model = make_model([helper.make_node("Relu", ["x"], ["y"])], [value("x", ["n", "c", 3])],
                       [value("y", None)])
    onnx.save(model, tmp_path / "dyn.onnx")
    with pytest.raises(ModelImportError, match="'x'.*fixed sample dimensions"):
        load_onnx(tmp_path / "dyn.onnx", 2)


def test_imported_net_trains(tmp_path):
    """A loss layer added to an imported LeNet; SGD steps on one batch reduce the loss."""
    torch.manual_seed(3)
    export(nn.Sequential(*list(lenet())[:-1]), (1, 28, 28), tmp_path / "lenet.onnx", dynamic=True)
    net, (data,), (logits,) = load_onnx(tmp_path / "lenet.onnx", 8, seed=0)
    label = MemoryDataLayer(net, "label", (1,))
    SoftmaxLossLayer("loss", net, logits, label)
    rng = np.random.default_rng(3)
    net.init()
    net.value(data)[...] = rng.standard_normal(net.value(data).shape).astype(np.float32)
    net.value(label)[:, 0] = rng.integers(0, 10, 8)
    losses = []
    for _ in range(12):
        net.forward()
        losses.append(net.loss)
        net.backward()
        net.update(0.1, momentum=0.9)
    assert losses[-1] < 0.5 * losses[0], losses
