"""A character-level LSTM language model on Python's own help text (``pydoc_data.topics``).

    latte run examples/char_rnn.py [--max-epoch N] [--threads N]
    mpiexec -n 2 latte run examples/char_rnn.py

The text is cut into sequences of ``STEPS`` characters; the net reads one character per
step and predicts the next (embedding -> LSTM -> linear -> softmax loss, averaged over the
batch and the steps), so its loss is the cross-entropy in nats per character. The last
tenth of the text is held out. Each epoch prints the training loss (its mean over the
epoch) and the held-out loss; the end prints the unigram entropy of the text (the loss of
a model that knows character frequencies and nothing else) and a sampled continuation.
"""

from __future__ import annotations

from collections import Counter
from pydoc_data.topics import topics

import numpy as np

from latte import Net
from latte.overrides import pick
from latte.runtime import distributed
from latte.solvers import Adam, LRPolicy, SolverParameters, solve
from latte.stdlib import ArrayDataLayer, EmbeddingLayer, FullyConnectedLayer, LSTMLayer, SoftmaxLossLayer

STEPS, BATCH, WIDTH, HIDDEN = 32, 32, 32, 128


def corpus() -> tuple[str, list[str]]:
    """The text (every help topic, in a fixed order) and its alphabet."""
    text = "".join(topics[k] for k in sorted(topics))
    return text, sorted(set(text))


def sequences(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``X`` ``(N, STEPS, 1)`` character ids and ``Y`` ``(N, STEPS)``, the next ids."""
    n = (len(ids) - 1) // STEPS
    x = ids[:n * STEPS].reshape(n, STEPS, 1).astype(np.float32)
    y = ids[1:n * STEPS + 1].reshape(n, STEPS)
    return x, y


def unigram_entropy(ids: np.ndarray) -> float:
    """Entropy in nats of the character frequencies."""
    p = np.array(list(Counter(ids.tolist()).values()), np.float64) / len(ids)
    return float(-(p * np.log(p)).sum())


def sample(net, seed: np.ndarray, length: int, rng: np.random.Generator,
           temperature: float = 0.7) -> list[int]:
    """``length`` ids drawn one at a time, each from the net's prediction at the last step
    of the ``STEPS`` ids before it (a window that slides by one; the state starts from zero
    at each window's first step, as in training)."""
    window, out = list(seed[-STEPS:]), []
    for _ in range(length):
        x = np.array(window, np.float32).reshape(1, STEPS, 1)
        logits = net.predict(x)[0, -1].astype(np.float64) / temperature
        p = np.exp(logits - logits.max())
        nxt = int(rng.choice(len(p), p=p / p.sum()))
        out.append(nxt)
        window = window[1:] + [nxt]
    return out


class EpochPrinter:
    """``solve``'s progress callback: prints each epoch's mean training loss and the
    held-out loss (on rank 0), then passes the event on (to ``latte run``'s progress bar)."""

    def __init__(self, then):
        self.then, self.losses = then, []

    def __call__(self, event: str, **info) -> None:
        if event == "iteration":
            self.losses.append(info["loss"])
        elif distributed.rank() == 0:
            print(f"epoch {info['epoch'] + 1}: train {np.mean(self.losses):.3f} nats/char, "
                  f"held-out {info['test_loss']:.3f} nats/char", flush=True)
            self.losses = []
        if self.then:
            self.then(event, **info)


def main() -> None:
    text, alphabet = corpus()
    index = {ch: i for i, ch in enumerate(alphabet)}
    ids = np.array([index[ch] for ch in text], np.int64)
    split = len(ids) * 9 // 10
    train, held_out = ids[:split], ids[split:]

    net = Net(BATCH, time_steps=STEPS, seed=0)
    chars, label = ArrayDataLayer(net, sequences(train), test=sequences(held_out), shuffle=True)
    emb = EmbeddingLayer("emb", net, chars, len(alphabet), WIDTH)
    h = LSTMLayer("lstm", net, emb, HIDDEN)
    logits = FullyConnectedLayer("out", net, h, len(alphabet))
    SoftmaxLossLayer("loss", net, logits, label)

    params = SolverParameters(lr_policy=LRPolicy.Fixed(0.003), max_epoch=3, clip_gradients=5.0)
    history = solve(Adam(params), net, EpochPrinter(pick("progress", None)))
    if distributed.rank() != 0:
        return
    entropy = unigram_entropy(train)
    print(f"unigram entropy of the text: {entropy:.3f} nats/char; held-out loss: "
          f"{history.test_loss[-1]:.3f} nats/char ({history.test_loss[-1] / entropy:.0%} of it)")
    seed = held_out[:STEPS]
    drawn = sample(net, seed, 300, np.random.default_rng(0))
    print("sampled continuation of " + repr("".join(alphabet[i] for i in seed)) + ":")
    print("".join(alphabet[i] for i in drawn))


if __name__ == "__main__":
    main()
