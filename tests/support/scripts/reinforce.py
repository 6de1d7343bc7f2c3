"""REINFORCE in the style of PyTorch's reinforcement_learning example: a policy network
whose forward returns action probabilities (softmax inside forward), Categorical
sampling, log-probs and rewards gathered over the steps of an episode, backward on
-(log_probs * returns).sum(), and an optimizer built after the first episode (as scripts
that size it from a first rollout do). The environment: walk a 1-D corridor to the goal
on the right. The metric: the mean greedy-action probability of moving right over a
fixed set of states after training, averaged with the mean return of the last episodes.
Knows nothing of mixed precision."""

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributions import Categorical

parser = argparse.ArgumentParser()
parser.add_argument("--episodes", type=int, default=150)
parser.add_argument("--gamma", type=float, default=0.95)
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()

torch.manual_seed(args.seed)
length, horizon = 6, 12


def observe(pos):
    obs = torch.zeros(length + 1)
    obs[pos] = 1.0
    return obs


class Policy(nn.Module):
    def __init__(self):
        super().__init__()
        self.affine1 = nn.Linear(length + 1, 32)
        self.affine2 = nn.Linear(32, 3)  # left, stay, right

    def forward(self, x):
        x = F.relu(self.affine1(x))
        return F.softmax(self.affine2(x), dim=-1)


policy = Policy()
optimizer = None


def run_episode(gen):
    pos, log_probs, rewards = 0, [], []
    for _ in range(horizon):
        probs = policy(observe(pos))
        m = Categorical(probs)
        action = m.sample()
        log_probs.append(m.log_prob(action))
        new = min(max(pos + int(action.item()) - 1, 0), length)
        done = new == length
        rewards.append(1.0 if done else 0.1 * (new - pos) - 0.05)
        pos = new
        if done:
            break
    return log_probs, rewards


recent = []
for episode in range(args.episodes):
    log_probs, rewards = run_episode(None)
    R, returns = 0.0, []
    for r in rewards[::-1]:
        R = r + args.gamma * R
        returns.insert(0, R)
    returns = torch.tensor(returns)
    returns = (returns - returns.mean()) / (returns.std() + 1e-6) if len(returns) > 1 else returns
    policy_loss = []
    for log_prob, R in zip(log_probs, returns):
        policy_loss.append(-log_prob * R)
    if optimizer is None:
        optimizer = torch.optim.Adam(policy.parameters(), lr=2e-2)
    optimizer.zero_grad()
    loss = torch.stack(policy_loss).sum()
    loss.backward()
    optimizer.step()
    recent.append(sum(rewards))
    if episode % 50 == 0:
        print(f"episode {episode} return {sum(rewards):.3f} steps {len(rewards)}")

with torch.no_grad():
    right = torch.stack([policy(observe(p))[2] for p in range(length)]).mean().item()
print(f"mean return of the last 30 episodes {sum(recent[-30:]) / 30:.4f}")
print(f"METRIC p_right {right:.5f}")
