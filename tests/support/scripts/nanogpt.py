"""A tiny GPT in nanoGPT's train.py style: forward(idx, targets) returns (logits, loss)
with the cross-entropy inside forward, tied embedding/head weights, AdamW over two
param groups (decay / no decay), the `ctx = nullcontext() if device_type == 'cpu' else
torch.autocast(...)` and `GradScaler(enabled=(dtype == 'float16'))` idioms, clipping
after scaler.unscale_, zero_grad(set_to_none=True), an @torch.no_grad() estimate_loss
with model.eval()/model.train(), torch.compile behind --compile. Knows nothing of ampkit."""

import argparse
import math
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--max_iters", type=int, default=60)
parser.add_argument("--compile", action="store_true")
parser.add_argument("--dtype", default="float32")
parser.add_argument("--grad_clip", type=float, default=1.0)
args = parser.parse_args()

torch.manual_seed(1337)
device_type = "cpu"
ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
ctx = nullcontext() if device_type == "cpu" else torch.amp.autocast(device_type=device_type, dtype=ptdtype)
block_size, vocab_size, n_embd, n_head, n_layer, batch_size = 16, 32, 32, 2, 2, 16

# a learnable sequence task with a noise floor: the next token is the previous one + 1
# (mod vocab_size) with probability 0.8, else uniformly random
def make(n, gen):
    seq = [torch.randint(0, vocab_size, (n,), generator=gen)]
    for _ in range(block_size):
        jump = torch.rand(n, generator=gen) < 0.2
        seq.append(torch.where(jump, torch.randint(0, vocab_size, (n,), generator=gen), (seq[-1] + 1) % vocab_size))
    data = torch.stack(seq, 1)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


train_gen = torch.Generator().manual_seed(0)
val_x, val_y = make(256, torch.Generator().manual_seed(1))


class CausalSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(n_embd, dim=2)
        k = k.view(B, T, n_head, C // n_head).transpose(1, 2)
        q = q.view(B, T, n_head, C // n_head).transpose(1, 2)
        v = v.view(B, T, n_head, C // n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention()
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd),
            wpe=nn.Embedding(block_size, n_embd),
            h=nn.ModuleList([Block() for _ in range(n_layer)]),
            ln_f=nn.LayerNorm(n_embd),
        ))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        else:
            logits = self.lm_head(x[:, [-1], :])
            loss = None
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, betas):
        param_dict = {pn: p for pn, p in self.named_parameters() if p.requires_grad}
        decay_params = [p for n, p in param_dict.items() if p.dim() >= 2]
        nodecay_params = [p for n, p in param_dict.items() if p.dim() < 2]
        optim_groups = [
            {"params": decay_params, "weight_decay": weight_decay},
            {"params": nodecay_params, "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(optim_groups, lr=learning_rate, betas=betas)


model = GPT()
scaler = torch.amp.GradScaler(device_type, enabled=(args.dtype == "float16"))
optimizer = model.configure_optimizers(0.1, 1e-2, (0.9, 0.95))
if args.compile:
    model = torch.compile(model)


@torch.no_grad()
def estimate_loss():
    model.eval()
    with ctx:
        _, loss = model(val_x, val_y)
    model.train()
    return loss.item()


def get_lr(it):
    warmup = 10
    if it < warmup:
        return 1e-2 * (it + 1) / (warmup + 1)
    ratio = (it - warmup) / max(1, args.max_iters - warmup)
    return 3e-4 + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (1e-2 - 3e-4)


X, Y = make(batch_size, train_gen)
for iter_num in range(args.max_iters):
    lr = get_lr(iter_num)
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr
    if iter_num % 20 == 0:
        print(f"step {iter_num}: val loss {estimate_loss():.4f}")
    with ctx:
        logits, loss = model(X, Y)
    X, Y = make(batch_size, train_gen)
    scaler.scale(loss).backward()
    if args.grad_clip != 0.0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)

print(f"METRIC val_loss {estimate_loss():.5f}")
