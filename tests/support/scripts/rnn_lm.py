"""A character-level RNN language model in the style of the classic word_language_model
example: no torch.optim, gradients clipped with clip_grad_norm_ and the update written
by hand through p.data. Knows nothing of mixed precision."""

import argparse
import math
import random
from pathlib import Path

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=150)
parser.add_argument("--bptt", type=int, default=32)
parser.add_argument("--batch", type=int, default=16)
parser.add_argument("--lr", type=float, default=1.0)
parser.add_argument("--clip", type=float, default=0.25)
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()

torch.manual_seed(args.seed)
text = Path(random.__file__).read_text()[:60000]
vocab = sorted(set(text))
ids = torch.tensor([vocab.index(c) for c in text])
split = int(len(ids) * 0.9)
train, valid = ids[:split], ids[split:]


def batchify(data, bsz):
    n = data.size(0) // bsz
    return data[: n * bsz].view(bsz, n).t().contiguous()


class RNNModel(nn.Module):
    def __init__(self, ntoken, ninp=32, nhid=64):
        super().__init__()
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.GRU(ninp, nhid)
        self.decoder = nn.Linear(nhid, ntoken)
        self.nhid = nhid

    def forward(self, input, hidden):
        output, hidden = self.rnn(self.encoder(input), hidden)
        return self.decoder(output), hidden

    def init_hidden(self, bsz):
        return torch.zeros(1, bsz, self.nhid)


model = RNNModel(len(vocab))
criterion = nn.CrossEntropyLoss()
train_data, valid_data = batchify(train, args.batch), batchify(valid, 8)


def get_batch(source, i):
    seq_len = min(args.bptt, len(source) - 1 - i)
    return source[i : i + seq_len], source[i + 1 : i + 1 + seq_len].reshape(-1)


def evaluate(source):
    model.eval()
    total, count = 0.0, 0
    hidden = model.init_hidden(source.size(1))
    with torch.no_grad():
        for i in range(0, source.size(0) - 1, args.bptt):
            data, targets = get_batch(source, i)
            output, hidden = model(data, hidden)
            total += len(data) * criterion(output.view(-1, len(vocab)), targets).item()
            count += len(data)
    return total / count


model.train()
hidden = model.init_hidden(args.batch)
i = 0
for step in range(args.steps):
    if i >= train_data.size(0) - 2:
        i = 0
        hidden = model.init_hidden(args.batch)
    data, targets = get_batch(train_data, i)
    i += args.bptt
    hidden = hidden.detach()
    model.zero_grad()
    output, hidden = model(data, hidden)
    loss = criterion(output.view(-1, len(vocab)), targets)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
    for p in model.parameters():
        p.data.add_(p.grad, alpha=-args.lr)
    if step % 50 == 0:
        print(f"step {step} loss {loss.item():.3f} ppl {math.exp(loss.item()):.1f}")

val_loss = evaluate(valid_data)
print(f"METRIC valid_loss {val_loss:.5f}")
