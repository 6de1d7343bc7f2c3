"""A two-optimizer GAN loop (the DCGAN example's structure) on a 1-D target N(3, 0.5):
the discriminator steps on real and detached fake samples, then the generator steps on
a loss that flows through the discriminator. Knows nothing of mixed precision."""

import argparse

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=300)
parser.add_argument("--batch", type=int, default=64)
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()

torch.manual_seed(args.seed)
nz = 4
netG = nn.Sequential(nn.Linear(nz, 32), nn.ReLU(), nn.Linear(32, 1))
netD = nn.Sequential(nn.Linear(1, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
criterion = nn.BCEWithLogitsLoss()
optimizerD = torch.optim.Adam(netD.parameters(), lr=2e-3, betas=(0.5, 0.999))
optimizerG = torch.optim.Adam(netG.parameters(), lr=2e-3, betas=(0.5, 0.999))
gen = torch.Generator().manual_seed(1)
real_label, fake_label = 1.0, 0.0

for step in range(args.steps):
    real = 3.0 + 0.5 * torch.randn(args.batch, 1, generator=gen)
    noise = torch.randn(args.batch, nz, generator=gen)
    # (1) update D: maximize log(D(x)) + log(1 - D(G(z)))
    netD.zero_grad()
    label = torch.full((args.batch, 1), real_label)
    errD_real = criterion(netD(real), label)
    fake = netG(noise)
    errD_fake = criterion(netD(fake.detach()), torch.full((args.batch, 1), fake_label))
    errD = errD_real + errD_fake
    errD.backward()
    optimizerD.step()
    # (2) update G: maximize log(D(G(z)))
    netG.zero_grad()
    errG = criterion(netD(fake), label)
    errG.backward()
    optimizerG.step()
    if step % 100 == 0:
        print(f"step {step} loss_D {errD.item():.4f} loss_G {errG.item():.4f}")

with torch.no_grad():
    samples = netG(torch.randn(20000, nz, generator=torch.Generator().manual_seed(2)))
print(f"METRIC sample_mean {samples.mean().item():.5f}")
