"""One compiled program per phase, chosen on the host.

Every 1-bit family runs its phases (warmup, compression, ...) inside one update, switched with ``lax.switch`` on
the update count. That is what an optax transformation must do: a user's ``jit`` compiles it once and it has to be
right at every step. But a conditional costs: the compiler materialises each branch's outputs and then copies
them into the donated state buffers (on XLA:CPU about a quarter of the compression step's memory traffic), and
the program holds every phase's code.

jonebit's step builders know more: before each step the state says which phase the next update runs
(``state.next_phase``, computed by the previous update with the same rule). :class:`PhasePrograms` reads it on
the host and runs a program compiled for that phase alone: the update calls :func:`run_phase`, which under
:func:`fixed_phases` calls only the named branch. The decision is the state's, so it is the same on every rank
and after a resume, and the arithmetic of each phase is the conditional's branch, unchanged.

The price is one small device-to-host read per step (the phase of the next update, which the previous step
computes): the host waits for the previous step before it dispatches the next.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

_FIXED: contextvars.ContextVar[dict | None] = contextvars.ContextVar("jonebit_fixed_phases", default=None)


@contextlib.contextmanager
def fixed_phases(phases):
    """While tracing inside, an update of a state type in ``phases`` (``(state type, phase name)`` pairs) runs only
    that phase."""
    token = _FIXED.set(dict(phases) if phases else None)
    try:
        yield
    finally:
        _FIXED.reset(token)


def run_phase(state_type: type, phase: jax.Array, branches: Sequence[Callable]):
    """``(outputs, phase)``: ``lax.switch(phase, branches, None)``, or, under :func:`fixed_phases` naming
    ``state_type``, the named branch alone and its index as a constant."""
    fixed = _FIXED.get()
    name = fixed.get(state_type) if fixed else None
    if name is None:
        return lax.switch(phase, list(branches), None), phase
    index = state_type.PHASES.index(name)
    if index >= len(branches):
        raise ValueError(f"{state_type.__name__}: phase {name!r} is not one this optimizer runs")
    return branches[index](None), jnp.asarray(index, jnp.int32)


def _is_phased(x) -> bool:
    return hasattr(type(x), "PHASES") and hasattr(x, "next_phase")


def has_phases(opt_state) -> bool:
    """Whether ``opt_state`` (arrays, or the same structure of specs) holds a 1-bit family state with phases."""
    return any(_is_phased(x) for x in jax.tree.leaves(opt_state, is_leaf=_is_phased))


def next_phases(opt_state) -> tuple | None:
    """``((state type, phase name), ...)`` of every 1-bit family state in ``opt_state`` (read from the device), or
    None where there is none, it is abstract (``ShapeDtypeStruct``), or copies of one type disagree."""
    states = [x for x in jax.tree.leaves(opt_state, is_leaf=_is_phased) if _is_phased(x)]
    if not states:
        return None
    leaves = [s.next_phase for s in states]
    if not all(isinstance(x, jax.Array | np.ndarray) for x in leaves):
        return None
    chosen: dict = {}
    for state, value in zip(states, jax.device_get(leaves), strict=True):
        name = type(state).PHASES[int(np.ravel(value)[0])]
        if chosen.setdefault(type(state), name) != name:
            return None
    return tuple(sorted(chosen.items(), key=lambda kv: kv[0].__qualname__))


def jit_per_phase(fn: Callable, *, per_phase: bool = True, state_arg: int = 1, **jit_kwargs):
    """``jax.jit(fn, **jit_kwargs)`` compiled once per phase (a :class:`PhasePrograms` reading the optimizer state at
    ``state_arg``), or, with ``per_phase=False``, the one jitted program with every phase."""
    def build(phases):
        def traced(*args):
            with fixed_phases(phases):
                return fn(*args)

        return jax.jit(traced, **jit_kwargs)

    return PhasePrograms(build, state_arg) if per_phase else build(None)


class PhasePrograms:
    """A step function compiled once per phase of the optimizer state it is given.

    ``build(phases)`` returns the jitted step for ``phases`` (as :func:`next_phases` gives them, ``None``: the one
    program with every phase); a call runs the program for the phases of the state at ``state_arg``
    (:meth:`program`). :meth:`lower` lowers the one program with every phase, whose conditional's branches the
    communication accounting reads phase by phase, or the program of given phases.
    """

    def __init__(self, build: Callable, state_arg: int = 1):
        self._build, self._state_arg, self._programs = build, state_arg, {}

    def program(self, *args):
        key = next_phases(args[self._state_arg])
        if key not in self._programs:
            self._programs[key] = self._build(key)
        return self._programs[key]

    def __call__(self, *args, **kwargs):
        return self.program(*args)(*args, **kwargs)

    def lower(self, *args, phases: tuple | None = None, **kwargs):
        """Lowers the one program with every phase, or with ``phases`` (as :func:`next_phases` gives them, e.g.
        ``((OneBitAdamState, "compression"),)``) the program of those phases, from abstract arguments too."""
        if phases not in self._programs:
            self._programs[phases] = self._build(phases)
        return self._programs[phases].lower(*args, **kwargs)

    def _cache_size(self) -> int:
        return sum(p._cache_size() for p in self._programs.values())

    @property
    def phases(self) -> list:
        """The phase combinations compiled so far."""
        return list(self._programs)
