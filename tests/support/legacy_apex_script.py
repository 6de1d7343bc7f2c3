"""A training script written the way apex.amp scripts were (2019-2022): register
functions, amp.initialize, two losses with loss_id, clipping of amp.master_params,
and the documented checkpoint recipe. tests/tools/test_apex_compat.py runs it with its
one import line switched to ampkit.compat.apex. Results go to --out (torch.save)."""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from apex import amp


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8 * 4 * 4, 16)
        self.ln = nn.LayerNorm(16)
        self.head = nn.Linear(16, 4)
        self.aux = nn.Linear(16, 1)

    def forward(self, x):
        h = F.relu(self.bn(self.conv(x)))
        h = self.fc(F.adaptive_avg_pool2d(h, 4).flatten(1))
        gate = torch.sigmoid(h)
        h = self.ln(h) * gate
        return self.head(h), self.aux(h), gate


@amp.float_function
def smooth_l1(pred, target):
    return F.smooth_l1_loss(pred, target)


def batch(step):
    g = torch.Generator().manual_seed(step % 3)  # a small fixed data set
    x = torch.randn(8, 3, 8, 8, generator=g)
    y = torch.randint(0, 4, (8,), generator=g)
    return x, y, x.mean(dim=(1, 2, 3)).unsqueeze(1)


def build(opt_level):
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = amp.initialize(
        model, optimizer, opt_level=opt_level, num_losses=2, loss_scale="dynamic"
    )
    return model, optimizer


def train(model, optimizer, start, stop, log):
    model.train()
    for step in range(start, stop):
        x, y, t = batch(step)
        logits, aux, gate = model(x)
        loss = F.cross_entropy(logits, y)
        aux_loss = smooth_l1(aux, t)
        optimizer.zero_grad()
        with amp.scale_loss(loss, optimizer, loss_id=0) as scaled_loss:
            scaled_loss.backward(retain_graph=True)
        with amp.scale_loss(aux_loss, optimizer, loss_id=1) as scaled_loss:
            scaled_loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), 10.0)
        optimizer.step()
        log.append((loss.item(), aux_loss.item(), float(norm), str(gate.dtype)))


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--opt-level", default="O1")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    amp.register_float_function(torch, "sigmoid")

    # Uninterrupted run.
    model, optimizer = build(args.opt_level)
    log = []
    train(model, optimizer, 0, args.steps, log)
    final = {k: v.clone() for k, v in model.state_dict().items()}

    # Interrupted run: checkpoint half way, rebuild everything, resume.
    half = args.steps // 2
    model, optimizer = build(args.opt_level)
    train(model, optimizer, 0, half, [])
    checkpoint = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "amp": amp.state_dict(),
    }
    torch.save(checkpoint, args.out + ".ckpt")
    model, optimizer = build(args.opt_level)
    checkpoint = torch.load(args.out + ".ckpt")
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    amp.load_state_dict(checkpoint["amp"])
    train(model, optimizer, half, args.steps, [])
    resumed = {k: v.clone() for k, v in model.state_dict().items()}

    model.eval()
    with torch.no_grad(), amp.disable_casts():
        x, _, _ = batch(999)
        eval_logits = model(x)[0]

    torch.save(
        {
            "log": log,
            "final": final,
            "resumed": resumed,
            "amp_state": amp.state_dict(),
            "eval_dtype": str(eval_logits.dtype),
        },
        args.out,
    )


if __name__ == "__main__":
    main()
