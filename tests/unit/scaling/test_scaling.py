"""LossScaler: the state machine against a reference model and torch's update kernel,
the fused unscale/check, state dicts, NumericsError and logging."""

from __future__ import annotations

import logging
import math
import random

import pytest
import torch
from _scaler_reference import RefScaler
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ampkit import LossScaler, NumericsError, ScalerError
from ampkit.scaling.loss_scaler import group_grads, to_fp32, unscale_and_check_


def make_scaler(cfg: dict) -> LossScaler:
    return LossScaler(**cfg)


def check_against_reference(cfg: dict, events: list[bool]) -> None:
    real = make_scaler(cfg)
    ref = RefScaler(cfg)
    for i, overflow in enumerate(events):
        expected = ref.event(overflow)
        if expected is None:
            real.update(overflow)
        else:
            with pytest.raises(NumericsError, match="min_scale" if expected == "floor" else "in a row"):
                real.update(overflow)
            return
        assert real.scale == ref.scale, (i, cfg, events[: i + 1])
        assert real.hysteresis_left == ref.hyst, (i, cfg)
        assert real.consecutive_skips == ref.in_a_row, (i, cfg)
        if cfg["dynamic"]:
            assert real.growth_tracker == ref.tracker(), (i, cfg)
        assert to_fp32(cfg["min_scale"]) <= real.scale or not cfg["dynamic"]
        assert real.scale <= to_fp32(cfg["max_scale"]) or not cfg["dynamic"]


@st.composite
def configs(draw):
    init = draw(st.sampled_from([1.0, 2.0, 3.0, 4.0, 2.0**8, 2.0**10, 2.0**16, 777.0, 1000.0, 12345.678]))
    min_scale = draw(st.sampled_from([1.0, 0.5, init / 4, init]))
    min_scale = min(min_scale, init)
    max_scale = draw(st.sampled_from([init, init * 8, 2.0**20, 2.0**24, math.inf]))
    max_scale = max(max_scale, init)
    return dict(
        init_scale=init,
        growth_factor=draw(st.sampled_from([2.0, 1.5, 3.0, 4.0, 1.0001])),
        backoff_factor=draw(st.sampled_from([0.5, 0.25, 0.3, 0.75, 0.9, 0.1234567])),
        growth_interval=draw(st.integers(1, 8)),
        hysteresis=draw(st.integers(1, 5)),
        min_scale=min_scale,
        max_scale=max_scale,
        dynamic=draw(st.booleans() | st.just(True)),
        consecutive_hysteresis=draw(st.booleans()),
        max_consecutive_skips=draw(st.none() | st.integers(0, 30)),
    )


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs(), events=st.lists(st.booleans(), max_size=150))
def test_state_machine_matches_reference_hypothesis(cfg, events):
    check_against_reference(cfg, events)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs(), events=st.lists(st.booleans(), max_size=120))
def test_the_pure_transition_is_the_reference_and_changes_nothing_it_is_given(cfg, events):
    """``next_state`` alone, with no scaler: a pure function of (state, config, event)
    that matches the reference rules event by event, leaves its inputs as they were,
    and reports in its event what ``LossScaler.update`` logs and raises (the floor, too
    many skips in a row)."""
    from ampkit.scaling.loss_scaler import CONFIG_KEYS, ScalerState, next_state

    config = {key: (to_fp32(v) if key in ("init_scale", "min_scale", "max_scale") and math.isfinite(v) else v)
              for key, v in cfg.items()}
    assert set(config) == set(CONFIG_KEYS)
    frozen = dict(config)
    ref = RefScaler(cfg)
    state = ScalerState(scale=to_fp32(cfg["init_scale"]), hysteresis_left=cfg["hysteresis"])
    for i, overflow in enumerate(events):
        expected = ref.event(overflow)
        before = state
        new, event = next_state(state, config, overflow)
        assert state == before and config == frozen  # nothing given was changed
        assert next_state(state, config, overflow) == (new, event)  # same inputs, same answer
        assert event.old_scale == state.scale and new.num_events == state.num_events + 1
        if expected == "floor":
            assert event.kind == "at_floor" and new.scale == state.scale
            return
        assert event.too_many_skips == (expected == "skips"), (i, cfg)
        assert new.scale == ref.scale and new.hysteresis_left == ref.hyst and new.consecutive_skips == ref.in_a_row
        assert event.kind == (
            ("grown" if new.scale != state.scale else "clean") if not overflow
            else "static" if not cfg["dynamic"]
            else "backed_off" if new.scale != state.scale
            else "tolerated"
        ), (i, event, cfg)
        if cfg["dynamic"]:
            assert new.growth_tracker == ref.tracker()
        if expected == "skips":
            return
        state = new


def test_a_scaler_pickled_with_its_configuration_as_attributes_loads():
    """0.3 kept a LossScaler's configuration as instance attributes; such a pickle loads,
    and the scaler steps and reports as the one that was saved."""
    import pickle

    s = LossScaler(init_scale=4.0, growth_interval=2, hysteresis=2)
    old = {k: v for k, v in vars(s).items() if k not in ("_current", "_on_read")}
    old.update(old.pop("_config"))  # the 0.3 layout: configuration and state as attributes
    old.update({f"_{key}": value for key, value in s.state()._asdict().items()})
    clone = LossScaler.__new__(LossScaler)
    clone.__setstate__(old)
    clone = pickle.loads(pickle.dumps(clone))
    assert clone.config() == s.config() and clone.growth_interval == 2
    for found in (False, False, True, True):
        s.update(found)
        clone.update(found)
    assert clone.state() == s.state()


def test_assigning_a_config_attribute_is_configure():
    """``scaler.growth_interval = 2`` takes effect at the next update and is validated like
    ``configure`` (a bad value is refused and changes nothing)."""
    s = LossScaler(init_scale=4.0, growth_interval=100)
    s.growth_interval = 2
    assert s.config()["growth_interval"] == 2
    s.update(False)
    s.update(False)
    assert s.scale == 8.0
    with pytest.raises(ScalerError):
        s.growth_interval = 0
    with pytest.raises(ScalerError):
        s.min_scale = 16.0  # the scale 8 would lie below it
    assert s.growth_interval == 2 and s.min_scale == 1.0 and s.scale == 8.0


@settings(max_examples=300, deadline=None)
@given(
    init=st.floats(1.0, 1e6),
    growth=st.floats(1.01, 4.0),
    backoff=st.floats(0.05, 0.99),
    interval=st.integers(1, 5),
    events=st.lists(st.booleans(), max_size=60),
)
def test_hysteresis_one_matches_torch_update_kernel(init, growth, backoff, interval, events):
    """hysteresis=1, no floor or cap in play: bit-identical to torch._amp_update_scale_."""
    ours = LossScaler(
        init_scale=init,
        growth_factor=growth,
        backoff_factor=backoff,
        growth_interval=interval,
        min_scale=1e-30,
        max_scale=math.inf,
        max_consecutive_skips=None,
    )
    scale = torch.full((), init, dtype=torch.float32)
    tracker = torch.zeros((), dtype=torch.int32)
    for overflow in events:
        found = torch.full((), float(overflow))
        torch._amp_update_scale_(scale, tracker, found, growth, backoff, interval)
        if scale.item() < 1e-29:
            break
        ours.update(overflow)
        assert ours.scale == scale.item()
        assert ours.growth_tracker == tracker.item()
        assert ours.scale_tensor("cpu").item() == scale.item()


def test_rules_by_hand():
    s = LossScaler(init_scale=8.0, growth_interval=2, hysteresis=2, min_scale=2.0, max_scale=16.0)
    s.update(True)  # tolerated
    assert (s.scale, s.hysteresis_left, s.consecutive_skips) == (8.0, 1, 1)
    s.update(True)  # backs off
    assert (s.scale, s.hysteresis_left) == (4.0, 1)
    s.update(False)
    s.update(False)  # growth refills hysteresis
    assert (s.scale, s.hysteresis_left, s.growth_tracker) == (8.0, 2, 0)
    for _ in range(4):
        s.update(False)
    assert s.scale == 16.0  # capped at max_scale
    s.update(False)
    s.update(False)
    assert s.scale == 16.0
    for _ in range(2):
        s.update(True)
    assert s.scale == 8.0
    s.update(True)
    assert s.scale == 4.0
    s.update(True)
    assert s.scale == 2.0  # floor
    with pytest.raises(NumericsError, match="min_scale=2"):
        s.update(True)
    assert s.scale == 2.0


def test_consecutive_hysteresis_refills_on_clean_steps():
    s = LossScaler(init_scale=8.0, hysteresis=2, consecutive_hysteresis=True)
    s.update(True)
    s.update(False)
    s.update(True)  # not in a row: tolerated again
    assert s.scale == 8.0
    s.update(True)  # two in a row: back off
    assert s.scale == 4.0


def test_max_consecutive_skips_and_off_switch():
    s = LossScaler(init_scale=4.0, dynamic=False, max_consecutive_skips=3)
    for _ in range(3):
        s.update(True)
    with pytest.raises(NumericsError, match="4 optimizer steps skipped in a row"):
        s.update(True)
    off = LossScaler(init_scale=4.0, dynamic=False, max_consecutive_skips=None)
    for _ in range(500):
        off.update(True)
    assert off.scale == 4.0 and off.consecutive_skips == 500
    off.update(False)
    assert off.consecutive_skips == 0


def test_default_scaler_raises_at_the_floor_after_sixteen_backoffs():
    s = LossScaler()
    for _ in range(16):
        s.update(True)
    assert s.scale == 1.0
    with pytest.raises(NumericsError) as err:
        s.update(True)
    assert "floor" in str(err.value) and "Check the inputs" in str(err.value)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(growth_factor=1.0),
        dict(backoff_factor=1.0),
        dict(backoff_factor=0.0),
        dict(growth_interval=0),
        dict(hysteresis=0),
        dict(init_scale=0.5),  # below min_scale=1
        dict(init_scale=2.0**25),  # above max_scale
        dict(init_scale=math.nan),
        dict(max_consecutive_skips=-1),
    ],
)
def test_invalid_configuration_raises_scaler_error(kwargs):
    with pytest.raises(ScalerError):
        LossScaler(**kwargs)


def test_state_dict_round_trip_is_exact():
    cfg = dict(init_scale=1000.0, growth_factor=1.7, backoff_factor=0.3, growth_interval=3, hysteresis=3)
    a = LossScaler(**cfg)
    rng = random.Random(0)
    events = [rng.random() < 0.4 for _ in range(40)]
    for e in events[:20]:
        a.update(e)
    b = LossScaler()
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict()
    assert b.scale_tensor("cpu").item() == a.scale
    for e in events[20:]:
        a.update(e)
        b.update(e)
        assert b.state_dict() == a.state_dict()
    with pytest.raises(ScalerError, match="lacks"):
        b.load_state_dict({"scale": 1.0})


def test_scale_and_inverse_tensors_are_fp32_and_follow_the_scale():
    s = LossScaler(init_scale=3.0)
    t, inv = s.scale_tensor("cpu"), s.inv_scale_tensor("cpu")
    assert t.dtype == inv.dtype == torch.float32 and t.dim() == 0
    assert inv.item() == torch.tensor(3.0, dtype=torch.float64).reciprocal().float().item()
    s.update(True)
    assert t.item() == 1.5 and s.scale == 1.5
    assert inv.item() == to_fp32(1 / 1.5)
    loss = torch.tensor(2.0, dtype=torch.float16)
    scaled = s.scale_loss(loss)
    assert scaled.item() == 3.0


def test_fused_unscale_and_check_groups_by_dtype():
    params = [
        torch.nn.Parameter(torch.ones(3)),
        torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16)),
        torch.nn.Parameter(torch.ones(2, dtype=torch.float16)),
        torch.nn.Parameter(torch.ones(1)),  # no grad
    ]
    for p in params[:3]:
        p.grad = torch.full_like(p, 8.0)
    groups = group_grads(params)
    assert sorted(str(dt) for _, dt in groups) == ["torch.bfloat16", "torch.float16", "torch.float32"]
    s = LossScaler(init_scale=4.0)
    found = s.unscale_(params)
    assert found is not None and found.dtype == torch.float32 and found.item() == 0.0
    for p in params[:3]:
        assert torch.equal(p.grad, torch.full_like(p, 2.0)) and p.grad.dtype == p.dtype
    params[1].grad[0] = float("nan")
    assert s.unscale_(params).item() == 1.0
    assert s.unscale_([params[3]]) is None
    with pytest.raises(ScalerError, match="FP16"):
        group_grads(params, allow_fp16=False)
    assert unscale_and_check_({}, 1.0) is None


def test_sparse_grads_are_checked():
    emb = torch.nn.Embedding(10, 3, sparse=True)
    emb(torch.tensor([1, 2])).sum().backward()
    emb.weight.grad = emb.weight.grad * float("inf")
    assert LossScaler().unscale_([emb.weight]).item() == 1.0


def test_overflow_events_are_logged_once_each(caplog):
    s = LossScaler(init_scale=8.0, hysteresis=2, name="loss 3")
    with caplog.at_level(logging.INFO, logger="ampkit"):
        s.update(False)
        s.update(True)
        s.update(True)
        s.update(False)
    records = [r for r in caplog.records if r.name == "ampkit"]
    assert len(records) == 2
    assert "loss 3" in records[0].getMessage() and "tolerated" in records[0].getMessage()
    assert "8 -> 4" in records[1].getMessage()


def test_overflow_log_only_on_rank_zero(caplog, monkeypatch):
    dist = torch.distributed
    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    s = LossScaler()
    with caplog.at_level(logging.INFO, logger="ampkit"):
        s.update(True)
    assert not [r for r in caplog.records if r.name == "ampkit"]
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    with caplog.at_level(logging.INFO, logger="ampkit"):
        s.update(True)
    assert len([r for r in caplog.records if r.name == "ampkit"]) == 1


def test_set_scale_and_new_like():
    s = LossScaler(init_scale=64.0, hysteresis=3, growth_interval=7)
    s.update(True)
    s.set_scale(1e9)
    assert s.scale == 2.0**24  # clamped to max_scale
    c = s.new_like()
    assert c.scale == 64.0 and c.hysteresis == 3 and c.growth_interval == 7
    assert c.hysteresis_left == 3
    with pytest.raises(ScalerError):
        s.set_scale(math.inf)


def test_load_state_dict_with_bad_config_changes_nothing():
    scaler = LossScaler(init_scale=8.0, growth_interval=3)
    before = scaler.state_dict()
    bad = dict(before, growth_factor=0.5, growth_interval=7)
    with pytest.raises(ScalerError):
        scaler.load_state_dict(bad)
    assert scaler.state_dict() == before


# --- next_state's inputs ---------------------------------------------------------------
def _scaler_inputs():
    """A good (state, config) of a dynamic scaler, mid-run: a growth tracker and a spent
    hysteresis budget."""
    scaler = LossScaler(init_scale=1024.0, growth_interval=5, hysteresis=3)
    for overflow in (False, True, False):
        scaler.update(overflow)
    return scaler.state(), scaler.config()


_DROP = object()  # a config change that removes the key
BAD_NEXT_STATE_INPUTS = {
    "scale nan": (dict(scale=math.nan), {}, False, "finite number > 0"),
    "scale inf": (dict(scale=math.inf), {}, False, "finite number > 0"),
    "scale zero": (dict(scale=0.0), {}, False, "finite number > 0"),
    "scale negative": (dict(scale=-1024.0), {}, False, "finite number > 0"),
    "scale subnormal": (dict(scale=1e-45), {}, False, "too small"),
    "scale not fp32": (dict(scale=0.1), {}, False, "not a float32 value"),
    "scale a str": (dict(scale="1024"), {}, False, "must be a number"),
    "scale a bool": (dict(scale=True), {}, False, "must be a number"),
    "scale above max_scale": (dict(scale=2.0**30), {}, False, "outside"),
    "scale below min_scale": (dict(scale=0.5), {}, False, "outside"),
    "negative counter": (dict(num_events=-1), {}, False, "num_events"),
    "float counter": (dict(growth_tracker=1.5), {}, False, "growth_tracker"),
    "hysteresis_left zero": (dict(hysteresis_left=0), {}, False, "hysteresis_left"),
    "hysteresis_left above hysteresis": (dict(hysteresis_left=9), {}, False, "hysteresis_left"),
    "counters inconsistent": (dict(num_overflows=50), {}, False, "inconsistent"),
    "events at the counter limit": (dict(num_events=2**63 - 1), {}, False, "num_events"),
    "growth_factor below one": ({}, dict(growth_factor=0.5), False, "growth_factor"),
    "growth_factor nan": ({}, dict(growth_factor=math.nan), False, "growth_factor"),
    "backoff_factor zero": ({}, dict(backoff_factor=0.0), False, "backoff_factor"),
    "backoff_factor above one": ({}, dict(backoff_factor=2.0), False, "backoff_factor"),
    "backoff_factor negative": ({}, dict(backoff_factor=-0.5), False, "backoff_factor"),
    "min_scale nan": ({}, dict(min_scale=math.nan), False, "min_scale"),
    "max_scale negative": ({}, dict(max_scale=-1.0), False, "max_scale"),
    "growth_interval zero": ({}, dict(growth_interval=0), False, "growth_interval"),
    "dynamic a str": ({}, dict(dynamic="yes"), False, "dynamic"),
    "config key missing": ({}, dict(hysteresis=_DROP), False, "lacks"),
    "config key unknown": ({}, dict(speed=2), False, "unknown key"),
    "found_inf the str 'False'": ({}, {}, "False", "must be a bool"),
    "found_inf an int": ({}, {}, 0, "must be a bool"),
    "found_inf None": ({}, {}, None, "must be a bool"),
    "found_inf a nan tensor": ({}, {}, torch.tensor(math.nan), "no flag"),
    "found_inf a negative tensor": ({}, {}, torch.tensor(-1.0), "no flag"),
    "found_inf a 1-d tensor": ({}, {}, torch.zeros(1), "0-dim"),
    "found_inf a complex tensor": ({}, {}, torch.tensor(0j), "0-dim bool or real"),
    "found_inf a meta tensor": ({}, {}, torch.zeros((), device="meta"), "with data"),
}


@pytest.mark.parametrize("case", list(BAD_NEXT_STATE_INPUTS))
def test_next_state_refuses_bad_inputs_with_a_scaler_error(case):
    """``next_state`` checks its state (a usable fp32 scale within the dynamic range,
    counters that fit the configuration), its configuration (the constructor's rules)
    and its event (a bool or a 0-dim flag tensor), and says what was wrong."""
    from ampkit.scaling import next_state

    state_changes, config_changes, found_inf, says = BAD_NEXT_STATE_INPUTS[case]
    state, config = _scaler_inputs()
    state = state._replace(**state_changes)
    config = {key: value for key, value in {**config, **config_changes}.items() if value is not _DROP}
    with pytest.raises(ScalerError, match=f"next_state.*{says}"):
        next_state(state, config, found_inf)


def test_next_state_refuses_a_state_that_is_not_a_scaler_state():
    from ampkit.scaling import next_state

    state, config = _scaler_inputs()
    with pytest.raises(ScalerError, match="ScalerState"):
        next_state(tuple(state), config, False)
    with pytest.raises(ScalerError, match="expected a dict"):
        next_state(state, list(config.items()), False)


@settings(max_examples=200, deadline=None)
@given(
    scale=st.floats(allow_nan=True, allow_infinity=True)
    .filter(lambda s: not (math.isfinite(s) and s > 0))
    .map(lambda s: s if math.isnan(s) else float(to_fp32(s)))
    | st.floats(min_value=2.0**-126, max_value=2.0**20).filter(lambda s: to_fp32(s) != s),
    found_inf=st.text() | st.integers() | st.floats() | st.none() | st.lists(st.booleans(), max_size=2),
)
def test_next_state_never_returns_an_unusable_scale_hypothesis(scale, found_inf):
    """No bad scale (NaN, inf, 0, negative, not fp32) and no flag that is not a bool or
    a flag tensor gets through: each raises ScalerError, nothing else."""
    from ampkit.scaling import next_state

    state, config = _scaler_inputs()
    with pytest.raises(ScalerError):
        next_state(state._replace(scale=scale), config, False)
    with pytest.raises(ScalerError):
        next_state(state, config, found_inf)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs(), events=st.lists(st.booleans(), max_size=60))
def test_next_state_takes_flag_tensors_and_agrees_with_the_scaler(cfg, events):
    """Good inputs keep their behaviour: a bool, a 0-dim bool tensor and the fp32 0/1
    flag unscale_ returns give the same answer, and that answer is what the scaler
    (LossScaler.update) stores event by event."""
    from ampkit.scaling import next_state

    scaler = LossScaler(**cfg)
    for overflow in events:
        state, config = scaler.state(), scaler.config()
        want = next_state(state, config, overflow)
        assert next_state(state, config, torch.tensor(overflow)) == want
        assert next_state(state, config, torch.tensor(float(overflow))) == want
        try:
            scaler.update(overflow)
        except NumericsError:
            assert want[1].kind == "at_floor" or want[1].too_many_skips
            return
        assert scaler.state() == want[0]


@pytest.mark.parametrize("overflow", [True, False])
def test_numpy_bools_are_flags_for_next_state_and_update(overflow):
    """A numpy bool (``np.bool_``, what comparing numpy values gives) is the flag it
    holds, to ``next_state`` and ``LossScaler.update`` alike."""
    np = pytest.importorskip("numpy")
    from ampkit.scaling import next_state

    scaler = LossScaler(init_scale=2.0**10)
    state, config = scaler.state(), scaler.config()
    assert next_state(state, config, np.bool_(overflow)) == next_state(state, config, overflow)
    scaler.update(np.bool_(overflow))
    assert scaler.state() == next_state(state, config, overflow)[0]
    assert scaler.scale == (2.0**9 if overflow else 2.0**10)


@pytest.mark.parametrize("flag", ["False", "", None, 1.5j, float("nan"), -1.0, torch.ones(2)])
def test_loss_scaler_update_refuses_what_is_no_flag(flag):
    """``LossScaler.update`` takes a bool or a 0-dim found-inf tensor: a string such as
    'False' (truthy) is refused, not taken as an overflow; the state is unchanged."""
    scaler = LossScaler(init_scale=2.0**10)
    before = scaler.state_dict()
    with pytest.raises(ScalerError, match="found_inf"):
        scaler.update(flag)
    assert scaler.state_dict() == before
    scaler.update(torch.tensor(True))
    assert scaler.scale == 2.0**9
