"""The AMP session: which optimizers (and their loss scalers) ampkit manages now.

:func:`ampkit.init_trainer` registers into the current session; ``ampkit.initialize``
starts a fresh one with :func:`new_session`. ``ampkit.state_dict()`` covers the
session's trainers in registration order (one entry per ``init_trainer`` call), so a
checkpoint from one run loads into a fresh run set up the same way.

What the checkpoint holds: every scaler's state, each managed optimizer's step
counters and any extra state registered by extensions (e.g. fp32 master weights). It
does not hold the optimizer's own ``state_dict()`` or the model's: save those as usual.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from ampkit._internal import registry as _reset
from ampkit._internal.validate import require_fields
from ampkit.errors import AmpError, StateError

__all__ = [
    "Session",
    "current_session",
    "new_session",
    "register_extra_state",
    "state_dict",
    "load_state_dict",
]

_FORMAT = "ampkit.session/1"

# Extra state of an optimizer or a session: (get_fn, set_fn, check_fn or None).
_Get = Callable[[], Any]
_Set = Callable[[Any], None]
_Check = Callable[[Any], None]
Extra = tuple[_Get, _Set, "_Check | None"]
#: ``register_extra_state(name, get_fn, set_fn, check_fn=None)``
ExtraRegister = Callable[..., None]


def require_keys(state_dict: Any, keys: Sequence[str], where: str, optional: Sequence[str] = ()) -> None:
    """Raise StateError unless ``state_dict`` is a dict with every key of ``keys`` and
    none outside ``keys`` and ``optional`` (part of an ``ampkit.state_dict()``)."""
    require_fields(state_dict, keys, where, StateError, optional)


class ExtraState:
    """Named extra state saved in ``ampkit.state_dict()`` (per optimizer, or for the
    session): per name a ``get_fn``, a ``set_fn`` and an optional ``check_fn`` that
    validates a saved value without changing anything. Loading checks every name and
    value (:meth:`check_names`, :meth:`check_values`) before :meth:`load` sets any."""

    def __init__(self, what: str, registrant: str) -> None:
        self.what = what  # "extra optimizer state", "extra session state"
        self.registrant = registrant  # "this run", "this session": who registers the names
        self.items: dict[str, Extra] = {}

    def register(self, name: str, get_fn: _Get, set_fn: _Set, check_fn: _Check | None = None) -> None:
        """Save ``get_fn()`` under ``name`` in ``ampkit.state_dict()``;
        ``ampkit.load_state_dict`` passes the saved value to ``set_fn``.

        ``check_fn(value)``, if given, validates a saved value without changing anything
        (raising an :class:`~ampkit.AmpError`); ``ampkit.load_state_dict`` runs every
        check of the checkpoint before any ``set_fn``, so a rejected checkpoint leaves
        everything as it was. ``set_fn`` must then not fail."""
        if name in self.items:
            raise StateError(f"{self.what} {name!r} is already registered.")
        self.items[name] = (get_fn, set_fn, check_fn)

    def state_dict(self) -> dict[str, Any]:
        return {name: get() for name, (get, _, _) in self.items.items()}

    def check_names(self, saved: Any, where: str, hint: str = "") -> None:
        """Raise StateError unless ``saved`` holds exactly the registered names."""
        if not isinstance(saved, Mapping) or set(saved) != set(self.items):
            shown = sorted(saved) if isinstance(saved, Mapping) else repr(saved)
            raise StateError(
                f"{where}{self.what} differs: checkpoint has {shown}, {self.registrant} "
                f"registers {sorted(self.items)}; set the run up the same way{hint} before loading."
            )

    def check_values(self, saved: Mapping[str, Any], where: str) -> None:
        """Run each ``check_fn`` on its saved value. Errors other than AmpError (a check
        tripping over a malformed value) become StateError."""
        for name, (_, _, check_fn) in self.items.items():
            if check_fn is None:
                continue
            try:
                check_fn(saved[name])
            except AmpError:
                raise
            except Exception as err:
                raise StateError(f"{where}: extra state {name!r} is malformed ({type(err).__name__}: {err}).") from err

    def load(self, saved: Mapping[str, Any]) -> None:
        for name, (_, set_fn, _) in self.items.items():
            set_fn(saved[name])


class SessionMember(Protocol):
    """What a session holds per ``init_trainer`` call (see ``ampkit.trainer.loss_slots.Trainer``)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any], where: str) -> None: ...

    def prepare_load(self, state_dict: Any, where: str) -> Callable[[], None]:
        """Validate ``state_dict`` completely, changing nothing; return the function
        that loads it (which must not fail)."""
        ...

    def release(self) -> None: ...


class Session:
    """An ordered registry of trainers plus session-wide extra state."""

    def __init__(self) -> None:
        self._members: list[SessionMember] = []
        self._extra = ExtraState("extra session state", "this session")
        self._closed = False

    @property
    def members(self) -> tuple[SessionMember, ...]:
        """The registered trainers, in registration order."""
        return tuple(self._members)

    def register(self, member: SessionMember) -> None:
        if self._closed:
            raise StateError("this AMP session was closed; use ampkit.trainer.current_session().")
        self._members.append(member)

    def unregister(self, member: SessionMember) -> None:
        self._members = [m for m in self._members if m is not member]

    @property
    def register_extra_state(self) -> ExtraRegister:
        """``register_extra_state(name, get_fn, set_fn, check_fn=None)``: save
        ``get_fn()`` under ``name`` in :meth:`state_dict` (:meth:`ExtraState.register`;
        names are unique per session)."""
        return self._extra.register

    def state_dict(self) -> dict[str, Any]:
        """``{"format", "trainers": [per init_trainer call], "extra": {name: value}}``."""
        return {
            "format": _FORMAT,
            "trainers": [m.state_dict() for m in self._members],
            "extra": self._extra.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` into a session set up the same way (same number
        of ``init_trainer`` calls, optimizers per call and losses, same extra state).

        All or nothing: the whole checkpoint -- every trainer's scalers, counters and
        extra state (fp32 masters, compensation buffers) -- is validated before anything
        is loaded; a rejected one raises an :class:`~ampkit.AmpError` (``StateError`` or
        ``ScalerError``) and leaves every trainer as it was."""
        self.prepare_load(state_dict)()

    def prepare_load(self, state_dict: Any) -> Callable[[], None]:
        """Validate a :meth:`state_dict` completely, changing nothing (raises as
        :meth:`load_state_dict` does), and return the function that loads it: callers
        that load more than ampkit's state (an integration's checkpoint) validate
        everything first and apply afterwards."""
        fmt = state_dict.get("format") if isinstance(state_dict, Mapping) else None
        if type(fmt) is not str or fmt != _FORMAT:
            raise StateError(
                "not an ampkit session state dict (expected the dict returned by "
                f"ampkit.state_dict(), whose 'format' is {_FORMAT!r})."
            )
        require_keys(state_dict, ("format", "trainers"), "the session state", optional=("extra",))
        trainers = state_dict["trainers"]
        if not isinstance(trainers, (list, tuple)) or len(trainers) != len(self._members):
            count = len(trainers) if isinstance(trainers, (list, tuple)) else repr(trainers)
            raise StateError(
                f"the checkpoint holds {count} trainer(s) but this session has "
                f"{len(self._members)}: call ampkit.init_trainer the same way (same order and "
                "number of calls) before loading."
            )
        extra = state_dict.get("extra", {})
        self._extra.check_names(extra, where="")
        loads = [
            member.prepare_load(sd, where=f"trainer {i}")
            for i, (member, sd) in enumerate(zip(self._members, trainers))
        ]
        self._extra.check_values(extra, "session")

        def apply() -> None:
            for load in loads:
                load()
            self._extra.load(extra)

        return apply

    @property
    def empty(self) -> bool:
        """Whether no optimizer and no extra state is registered in this session."""
        return not self._members and not self._extra.items

    def close(self) -> None:
        """Release every trainer (optimizers get their own ``step`` back)."""
        for member in reversed(self._members):
            member.release()
        self._members = []
        self._extra.items.clear()
        self._closed = True


# Module state: the current AMP session is process-wide by design (see ampkit.reset).
_current = Session()


def current_session() -> Session:
    """The session :func:`ampkit.init_trainer` registers into."""
    return _current


def new_session() -> Session:
    """Close the current session (its optimizers are released and get their own
    ``step`` back) and start an empty one, which becomes current."""
    global _current
    _current.close()
    _current = Session()
    return _current


def register_extra_state(name: str, get_fn: _Get, set_fn: _Set, check_fn: _Check | None = None) -> None:
    """Register session-wide extra state in the current session (see
    :meth:`ExtraState.register`). Per-optimizer extra state goes through
    ``ampkit.trainer.api.managed_state(opt).register_extra_state``."""
    _current.register_extra_state(name, get_fn, set_fn, check_fn)


def state_dict() -> dict[str, Any]:
    """The current session's state: every managed optimizer's scalers, counters and
    extra state, in registration order. Save it next to the model and optimizer state."""
    return _current.state_dict()


def load_state_dict(state_dict: dict[str, Any]) -> None:
    """Load :func:`state_dict` output into the current session, which must be set up
    the same way as the one that saved it."""
    _current.load_state_dict(state_dict)


def prepare_load_state_dict(state_dict: Any) -> Callable[[], None]:
    """Validate :func:`state_dict` output against the current session, changing
    nothing, and return the function that loads it (:meth:`Session.prepare_load`)."""
    return _current.prepare_load(state_dict)


_reset.on_reset(new_session)
