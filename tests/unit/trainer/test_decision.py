"""The skip rule of ``ampkit.trainer.decision``, tested directly: a process alone, the
device encoding ranks all-reduce, and ranks combined by MAX, against the rule as its
module docstring states it (written out again here, segment by segment)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ampkit import DistributedError
from ampkit.trainer.decision import decide, encode

NUM_LOSSES = 3

# one segment: (loss id or None, its found-inf flag: None for no grads, 0.0 clean, 1.0 overflow)
segment = st.tuples(st.none() | st.integers(0, NUM_LOSSES - 1), st.none() | st.sampled_from([0.0, 1.0]))


def _tensors(segments):
    return [(i, None if f is None else torch.tensor(f)) for i, f in segments]


def _reference(segments):
    """The rule: skip if any segment overflowed; loss k overflowed if one of its segments
    is the step's first overflowing one, unknown (None) if one of its segments comes after
    that, else clean; loss ids the step did not scale are absent."""
    first = next((j for j, (_, f) in enumerate(segments) if f == 1.0), None)
    events = {}
    for k in range(NUM_LOSSES):
        mine = [j for j, (i, _) in enumerate(segments) if i == k]
        if not mine:
            continue
        if first is not None and first in mine:
            events[k] = True
        elif first is not None and any(j > first for j in mine):
            events[k] = None
        else:
            events[k] = False
    return events, first is not None


class _Max:
    """An agreement over fake ranks: ``reduce`` takes the element-wise MAX with the other
    ranks' vectors, as the all-reduce does."""

    device = torch.device("cpu")

    def __init__(self, others):
        self.others = others

    def reduce(self, tensor):
        for other in self.others:
            torch.maximum(tensor, other, out=tensor)


@settings(max_examples=400, deadline=None)
@given(st.lists(segment, max_size=8))
def test_alone_and_encoded_the_rule_decides_as_stated(segments):
    want = _reference(segments)
    assert decide(_tensors(segments), NUM_LOSSES) == want
    # the device path (ranks that agree), with no other rank: the same answer
    assert decide(_tensors(segments), NUM_LOSSES, _Max([])) == want


@settings(max_examples=300, deadline=None)
@given(st.lists(st.none() | st.integers(0, NUM_LOSSES - 1), max_size=6), st.data())
def test_ranks_combined_by_max_decide_as_any_overflow_then_any_unknown(loss_ids, data):
    """Two ranks with the same scale_loss calls and their own flags: the all-reduced
    decision skips if either rank would, and each loss is an overflow if it is on either
    rank, else unknown if it is on either, else clean."""
    flags = st.none() | st.sampled_from([0.0, 1.0])
    ranks = [[(i, data.draw(flags)) for i in loss_ids] for _ in range(2)]
    alone = [_reference(r) for r in ranks]
    vectors = [encode(_tensors(r), NUM_LOSSES, torch.device("cpu")) for r in ranks]
    events, skip = decide(_tensors(ranks[0]), NUM_LOSSES, _Max(vectors[1:]))
    assert set(events) == {i for i in loss_ids if i is not None}
    assert skip == (alone[0][1] or alone[1][1])
    for k in events:
        mine = [a[0][k] for a in alone]
        assert events[k] == (True if True in mine else None if None in mine else False), (k, ranks)


def test_a_loss_id_scaled_on_one_rank_only_is_refused():
    here = [(0, torch.tensor(0.0))]
    there = encode([(0, torch.tensor(0.0)), (1, torch.tensor(0.0))], NUM_LOSSES, torch.device("cpu"))
    with pytest.raises(DistributedError, match=r"loss id\(s\) \[1\] were scaled on some ranks"):
        decide(here, NUM_LOSSES, _Max([there]))
