"""A corruption sweep of ``save_checkpoint`` folders, in one process: the entries of an
O2K and an O2 checkpoint (the model's tensors, the optimizer's state and hyperparameters,
ampkit's state) rewritten with values no run saves or that training never produces, one
case of every kind (the entry's path with its layer and index numbers dropped, the saved
value's dtype or type, the mutation; drawn with a fixed seed among the layers and
indices that repeat a kind), saved with fresh checksums (corruption before the hash, or
an attacker who rehashes), and loaded into a trained session. Each load is refused with
an ``AmpError`` and changes nothing, or is accepted and the next steps leave every
weight and optimizer value finite (harmful: a non-finite one): 0 harmful, 0 raw errors,
0 changes on refusal. A finite, representable value no run could tell from a trained one
(a bf16 weight of 1e38) is accepted; its overflow is then skipped like any other, visibly
(``amp.stats``, the skip limit), never taken. (Changed bytes under the saved checksums
are refused by the checksum, tested in test_checkpoint_files.py.)"""

from __future__ import annotations

import math
import random
import re
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_checkpoint_files import _build, _same, _snapshot, _train
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import ampkit
from ampkit.distributed import load_checkpoint, save_checkpoint
from ampkit.distributed.dcp_files import write_checksums

pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled"), pytest.mark.slow]


def _leaves(tree: Any, path: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _leaves(v, (*path, k))
    elif isinstance(tree, (list, tuple)) and not (tree and all(isinstance(v, (int, float)) for v in tree)):
        for i, v in enumerate(tree):
            yield from _leaves(v, (*path, i))
    else:
        yield path, tree


def _set(tree: Any, path: tuple, value: Any) -> Any:
    """A copy of ``tree`` with the leaf at ``path`` replaced (containers copied on the way)."""
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(tree, dict):
        return {**tree, head: _set(tree[head], rest, value)}
    items = list(tree)
    items[head] = _set(items[head], rest, value)
    return type(tree)(items) if isinstance(tree, tuple) else items


def _tensor_mutations(t: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    if t.is_floating_point():
        for name, value in (("nan", math.nan), ("inf", math.inf), ("-1", -1.0), ("1e38", 1e38)):
            bad = t.clone()
            bad.view(-1)[0] = value if t.numel() else 0
            yield name, bad
    elif t.dtype in (torch.int64, torch.int32):
        for name, value in (("-1", -1), ("huge", 2**62)):
            yield name, torch.full_like(t, value)
    elif t.dtype == torch.uint8 and t.dim() == 1:  # a saved string
        yield "other string", torch.tensor(list(b"x" * t.numel()), dtype=torch.uint8)
    yield "float64", t.to(torch.float64) if t.dtype != torch.float64 else t.to(torch.float32)


def _value_mutations(v: Any) -> Iterator[tuple[str, Any]]:
    yield from (("str", "0.1"), ("None", None), ("dict", {"a": 1}), ("nan", math.nan), ("-1", -1.0),
                ("1e30", 1e30))  # fmt: skip


def _kind(path: tuple, leaf: Any, name: str) -> str:
    """What a case exercises: where (``model/#.weight``, ``optim/state/#.bias/exp_avg``,
    ``amp/trainers/#/scalers/#/scale``: the layers and indices that repeat an entry are
    one), the saved value's dtype or type, and the mutation."""
    where = "/".join(re.sub(r"\d+", "#", str(p)) for p in path)
    return f"{where} {leaf.dtype if isinstance(leaf, torch.Tensor) else type(leaf).__name__} {name}"


def _one_of_each_kind(cases: list[tuple[str, tuple, str, Any]], seed: int = 0) -> list[tuple[tuple, str, Any]]:
    """``(path, name, value)`` of one case per kind, drawn with a fixed seed."""
    by_kind: dict[str, list[tuple[tuple, str, Any]]] = {}
    for kind, *case in cases:
        by_kind.setdefault(kind, []).append(tuple(case))
    rng = random.Random(seed)
    return [rng.choice(group) for group in by_kind.values()]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("level", ["O2K", "O2"])
def test_every_kind_of_entry_corrupted_is_refused_or_harmless(tmp_path, level):
    warnings.simplefilter("ignore")
    model, opt = _build(level)
    _train(model, opt, 3)
    save_checkpoint(tmp_path / "good", model, opt)
    dcp_to_torch_save(tmp_path / "good", tmp_path / "good.pt")  # the folder's contents, nested
    state = torch.load(tmp_path / "good.pt", weights_only=True)
    cases = []
    for path, leaf in _leaves(state):
        if path[:2] == ("optim", "param_groups") and path[-1] == "params":
            continue  # names, checked by DCP's own mapping
        mutations = _tensor_mutations(leaf) if isinstance(leaf, torch.Tensor) else _value_mutations(leaf)
        cases += [(_kind(path, leaf, name), path, name, value) for name, value in mutations]
    entries = len(cases)
    cases = _one_of_each_kind(cases)
    # the session the corrupt folders are loaded into: trained past the checkpoint
    ampkit.reset()
    model, opt = _build(level)
    _train(model, opt, 2, seed=5)
    outcomes = {"refused": 0, "accepted": 0, "skipping": 0}
    harmful, raw, changed = [], [], []
    for i, (path, name, value) in enumerate(cases):
        folder = tmp_path / f"c{i}"
        mutated = _set(state, path, value)
        try:
            dcp.save(mutated, checkpoint_id=str(folder))
        except Exception:  # noqa: BLE001 - a value DCP cannot even save is not a case
            continue
        write_checksums(folder, 0, is_coordinator=True)
        before = _snapshot(model, opt)
        try:
            load_checkpoint(folder, model, opt)
        except ampkit.AmpError:
            outcomes["refused"] += 1
            if not _same(before, _snapshot(model, opt)):
                changed.append((path, name))
            continue
        except Exception as exc:  # noqa: BLE001 - counted: must be none
            raw.append((path, name, f"{type(exc).__name__}: {exc}"[:200]))
            continue
        outcomes["accepted"] += 1
        skipped_before = ampkit.stats(opt).skipped
        _train(model, opt, 2, seed=7)
        outcomes["skipping"] += ampkit.stats(opt).skipped > skipped_before
        values = [p.detach() for p in model.parameters()]
        values += [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
        if not all(bool(torch.isfinite(t).all()) for t in values):
            harmful.append((path, name))
        ampkit.reset()
        model, opt = _build(level)
        _train(model, opt, 2, seed=5)
    assert entries > len(cases) > 150, (entries, len(cases))
    assert not raw, raw[:5]
    assert not changed, changed[:5]
    assert not harmful, "; ".join(f"{p}:{n}" for p, n in harmful)
    assert outcomes["refused"] > outcomes["accepted"], outcomes
