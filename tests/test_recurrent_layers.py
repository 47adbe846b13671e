"""Recurrent layers and the embedding against PyTorch (float64): PyTorch's weights loaded
by name, outputs, the loss (softmax averaged over batch and steps) and every gradient
compared at opt levels 0 and 3 (two threads)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import WeightedSumLoss, assert_scaled_close

from latte import Net
from latte.compiler.ir import BinOp, Load, walk
from latte.compiler.printer import format_ir
from latte.errors import DataError, ShapeError
from latte.stdlib import (
    EmbeddingLayer,
    FullyConnectedLayer,
    GRULayer,
    LSTMLayer,
    MemoryDataLayer,
    RNNLayer,
    SoftmaxLossLayer,
)

torch = pytest.importorskip("torch")

CLASSES = 5
RTOL = 1e-4
LAYERS = {"lstm": (LSTMLayer, torch.nn.LSTM), "gru": (GRULayer, torch.nn.GRU),
          "rnn": (RNNLayer, torch.nn.RNN)}
levels = pytest.mark.parametrize("opt_level,threads", [(0, 1), (3, 2)], ids=["o0", "o3t2"])


def torch_model(kind: str, n_in: int, hidden: int, layers: int, vocab: int | None, seed: int):
    """The PyTorch twin: [embedding], ``layers`` stacked recurrent layers, a linear per
    step; float64 holding float32-representable weights."""
    torch.manual_seed(seed)
    parts = {"rnn": LAYERS[kind][1](n_in, hidden, num_layers=layers, dtype=torch.float64),
             "out": torch.nn.Linear(hidden, CLASSES, dtype=torch.float64)}
    if vocab:
        parts["emb"] = torch.nn.Embedding(vocab, n_in, dtype=torch.float64)
    model = torch.nn.ModuleDict(parts)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.float().double())
    return model


def latte_name(torch_name: str) -> str:
    """``rnn.weight_ih_l1`` -> ``rnn1.weight_ih``; ``out.weight`` -> ``out.weights``."""
    part, field = torch_name.split(".")
    if part == "rnn":
        field, layer = field.rsplit("_l", 1)
        return f"rnn{layer}.{field}"
    return f"{part}.{ {'weight': 'weights'}.get(field, field) if part == 'out' else field}"


def build(kind: str, steps: int, batch: int, n_in: int, hidden: int, layers: int,
          vocab: int | None, opt_level: int, threads: int) -> Net:
    net = Net(batch, time_steps=steps, opt_level=opt_level, num_threads=threads, seed=1)
    x = MemoryDataLayer(net, "x", (1,) if vocab else (n_in,))
    label = MemoryDataLayer(net, "label", (1,))
    h = EmbeddingLayer("emb", net, x, vocab, n_in) if vocab else x
    for k in range(layers):
        h = LAYERS[kind][0](f"rnn{k}", net, h, hidden)
    out = FullyConnectedLayer("out", net, h, CLASSES)
    SoftmaxLossLayer("loss", net, out, label)
    return net


def compare(kind: str, steps: int, batch: int, layers: int, opt_level: int, threads: int, *,
            n_in: int = 3, hidden: int = 4, vocab: int | None = None) -> None:
    rng = np.random.default_rng(steps * 100 + batch * 10 + layers)
    model = torch_model(kind, n_in, hidden, layers, vocab, seed=steps + layers)
    net = build(kind, steps, batch, n_in, hidden, layers, vocab, opt_level, threads)
    net.init()
    params = {p.name: p for p in net.params}
    tparams = dict(model.named_parameters())
    assert sorted(params) == sorted(latte_name(n) for n in tparams)
    for name, t in tparams.items():
        p = params[latte_name(name)]
        p.value[...] = t.detach().numpy().reshape(p.value.shape)
    if vocab:
        x = rng.integers(0, vocab, (steps, batch)).astype(np.float64)
    else:
        x = rng.standard_normal((steps, batch, n_in))
    y = rng.integers(0, CLASSES, (steps, batch))
    net.value("x")[...] = x.reshape(net.value("x").shape)
    net.value("label")[..., 0] = y
    net.forward()
    net.backward()

    tx = torch.tensor(x, requires_grad=not vocab)
    seq = model["emb"](tx.long()) if vocab else tx
    hs, _ = model["rnn"](seq)
    logits = model["out"](hs)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, CLASSES), torch.tensor(y).reshape(-1))
    loss.backward()
    assert abs(net.loss - loss.item()) <= RTOL * abs(loss.item())
    assert_scaled_close(net.value(f"rnn{layers - 1}"), hs.detach().numpy(), RTOL, "hidden outputs")
    assert_scaled_close(net.value("out"), logits.detach().numpy(), RTOL, "logits")
    if not vocab:
        assert_scaled_close(net.grad("x"), tx.grad.numpy(), RTOL, "gradient of x")
    for name, t in tparams.items():
        p = params[latte_name(name)]
        assert_scaled_close(p.grad, t.grad.numpy().reshape(p.grad.shape), RTOL, f"gradient of {name}")


CASES = [("lstm", 2, 1, 1), ("lstm", 7, 3, 2), ("gru", 2, 3, 1), ("gru", 7, 2, 2),
         ("rnn", 2, 2, 1), ("rnn", 7, 3, 2)]


@levels
@pytest.mark.parametrize("kind,steps,batch,layers", CASES,
                         ids=[f"{k}-T{t}-b{b}-l{n}" for k, t, b, n in CASES])
def test_against_torch(kind, steps, batch, layers, opt_level, threads):
    compare(kind, steps, batch, layers, opt_level, threads)


@levels
@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_long_sequence(kind, opt_level, threads):
    """T = 50: gradients flow back through every step."""
    compare(kind, 50, 2, 1, opt_level, threads, n_in=4, hidden=6)


@levels
def test_embedding_lstm(opt_level, threads):
    """Embedding -> LSTM -> linear, the char-RNN's shape, against nn.Embedding + nn.LSTM."""
    compare("lstm", 5, 3, 1, opt_level, threads, n_in=4, hidden=5, vocab=7)


@levels
def test_embedding(opt_level, threads):
    """The lookup alone, without time steps: values and the table's gradient (rows
    selected twice accumulate, rows never selected get zero); rows in whole blocks of 16
    and past them."""
    vocab, dim, batch = 37, 5, 7
    net = Net(batch, opt_level=opt_level, num_threads=threads, seed=2)
    ids = MemoryDataLayer(net, "ids", (1,))
    emb = EmbeddingLayer("emb", net, ids, vocab, dim)
    loss = WeightedSumLoss(net, "loss", emb)
    net.init()
    (table,) = net.params
    assert table.name == "emb.weight" and table.value.shape == (vocab, dim)
    x = np.array([3, 0, 3, 36, 16, 33, 31])
    net.value(ids)[:, 0] = x
    net.forward()
    net.backward()
    temb = torch.nn.Embedding(vocab, dim, dtype=torch.float64)
    with torch.no_grad():
        temb.weight.copy_(torch.tensor(table.value, dtype=torch.float64))
    out = temb(torch.tensor(x))
    (out * torch.tensor(loss.w, dtype=torch.float64)).sum().backward()
    assert_scaled_close(net.value(emb), out.detach().numpy(), RTOL, "embedding")
    assert_scaled_close(table.grad, temb.weight.grad.numpy(), RTOL, "gradient of the table")


def test_embedding_table_is_published_as_pytorch_lays_it_out(tmp_path):
    """The table is stored a column per output and published ``(vocab, dim)``: the value,
    the gradient, the solver's history and a snapshot all in that layout, element for
    element. The lookup costs loads, not a product: the compiled forward has no multiply."""
    vocab, dim, batch = 37, 20, 6
    net = Net(batch, seed=1)
    ids = MemoryDataLayer(net, "ids", (1,))
    emb = EmbeddingLayer("emb", net, ids, vocab, dim)
    loss = WeightedSumLoss(net, "loss", emb)
    net.init()
    (table,) = net.params
    w = np.random.default_rng(0).standard_normal((vocab, dim)).astype(np.float32)
    table.value[...] = w
    x = np.array([5, 36, 5, 0, 17, 31])
    net.value(ids)[:, 0] = x
    net.forward()
    np.testing.assert_array_equal(net.value(emb), w[x])
    net.backward()
    grad = np.zeros_like(w)
    np.add.at(grad, x, np.broadcast_to(loss.w, (batch, dim)))
    np.testing.assert_allclose(table.grad, grad, rtol=1e-6)
    net.update(0.1, 0.9, 0.01)   # history = 0.1 * (grad + 0.01 * w); value = w - history
    np.testing.assert_allclose(table.history, 0.1 * (grad + 0.01 * w), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(table.value, w - table.history, rtol=1e-6, atol=1e-7)
    net.save(tmp_path / "snap.h5")
    saved, history = table.value.copy(), table.history.copy()
    table.value[...], table.history[...] = 0.0, 0.0
    net.load(tmp_path / "snap.h5")
    np.testing.assert_array_equal(table.value, saved)
    np.testing.assert_array_equal(table.history, history)
    forward = next(k for p in net.program.plans if p.ensemble is emb
                   for name, k in p.kernels.items() if name == "forward")
    loads_multiplied = [n for n in walk(forward.body) if isinstance(n, BinOp) and n.op == "*"
                        and any(isinstance(x, Load) for x in (n.lhs, n.rhs))]
    assert not loads_multiplied, format_ir(forward)


@pytest.mark.parametrize("bad", [-1.0, 6.0, 2.5])
def test_embedding_rejects_bad_ids(bad):
    net = Net(2, time_steps=2, opt_level=0, seed=0)
    ids = MemoryDataLayer(net, "ids", (1,))
    EmbeddingLayer("emb", net, ids, 6, 3)
    net.init()
    net.value(ids)[...] = 1.0
    net.value(ids)[1, 0, 0] = bad
    with pytest.raises(DataError, match="'emb'.*'ids'"):
        net.forward()


def test_embedding_needs_one_id():
    net = Net(2, seed=0)
    with pytest.raises(ShapeError, match="'emb'"):
        EmbeddingLayer("emb", net, MemoryDataLayer(net, "ids", (2,)), 6, 3)
