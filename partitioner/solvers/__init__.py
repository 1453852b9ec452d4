"""Placement solvers and their registry: the one list of solvers.

Every solver is a frozen dataclass implementing :class:`~partitioner.solvers.base.Solver` (one
module of this package each, or a few small ones together as in ``baselines.py``); its fields are
its options, its ``name``, ``description`` and ``uses_time_limit`` are class constants.
:data:`SOLVERS` maps each registered solver's ``name`` to its class, in the order of
:data:`_REGISTERED` (simplest first: the order the docs and benchmark tables list them), and is
read-only. The CLI's choices, the docs and the benchmarks read it (:func:`solver_names`,
:func:`fast_solver_names`, each class's ``description``); :func:`get_solver` builds one from a
name and options (strings from the command line are converted to the option's type).

Adding a solver: write ``partitioner/solvers/<name>.py`` with a frozen dataclass subclassing
:class:`~partitioner.solvers.base.SolverOptions` (``name``, ``description``, ``solve``), then
register it here: import the class and add it to :data:`_REGISTERED`.
"""

from __future__ import annotations

import logging
import time
import typing
from collections.abc import Mapping
from dataclasses import fields, replace
from types import MappingProxyType
from typing import Any

from partitioner.core.errors import SolverError
from partitioner.core.ir import CostedGraph, SolverResult
from partitioner.simulation.evaluate import PlanEvaluation, evaluate
from partitioner.solvers.auto import AutoSolver
from partitioner.solvers.base import Solver
from partitioner.solvers.baselines import (
    EvenSolver,
    ParamsSolver,
    RoundRobinSolver,
    SingleSolver,
    TimeSolver,
)
from partitioner.solvers.dp import PipeDreamSolver
from partitioner.solvers.etf import EtfSolver
from partitioner.solvers.ilp import IlpSolver
from partitioner.solvers.metis import MetisSolver

__all__ = ["SOLVERS", "Solver", "fast_solver_names", "get_solver", "solve", "solver_names"]

logger = logging.getLogger(__name__)

_REGISTERED: tuple[type[Solver], ...] = (
    SingleSolver,
    EvenSolver,
    RoundRobinSolver,
    ParamsSolver,
    TimeSolver,
    PipeDreamSolver,
    EtfSolver,
    MetisSolver,
    IlpSolver,
    AutoSolver,
)
"""Every solver, simplest first; registering a new one is its import above and one line here."""

SOLVERS: Mapping[str, type[Solver]] = MappingProxyType({cls.name: cls for cls in _REGISTERED})


def solver_names() -> tuple[str, ...]:
    """The registered solver names, sorted."""
    return tuple(sorted(SOLVERS))


def fast_solver_names() -> tuple[str, ...]:
    """The registered solvers that ignore ``time_limit_s`` (heuristics and baselines), in
    registry order."""
    return tuple(name for name, cls in SOLVERS.items() if not cls.uses_time_limit)


def _coerce(name: str, option: str, value: Any, hint: Any) -> Any:
    if not isinstance(value, str) or hint is str:
        return value
    try:
        if hint is bool:
            lowered = value.strip().lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if hint is int:
            return int(value)
        if hint is float:
            return float(value)
    except ValueError:
        hint_name = getattr(hint, "__name__", str(hint))
        raise SolverError(
            f"solver {name!r} option {option}={value!r} is not a valid {hint_name}"
        ) from None
    return value


def get_solver(name: str, **options: Any) -> Solver:
    """Build the solver called ``name`` with ``options``; raise SolverError if either is unknown."""
    cls = SOLVERS.get(name)
    if cls is None:
        raise SolverError(f"unknown solver {name!r}; known: {', '.join(solver_names())}")
    known = tuple(f.name for f in fields(cls))  # type: ignore[arg-type]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise SolverError(
            f"solver {name!r} has no option {', '.join(unknown)}; its options: {', '.join(known)}"
        )
    hints = typing.get_type_hints(cls)
    converted = {k: _coerce(name, k, v, hints.get(k)) for k, v in options.items()}
    try:
        return cls(**converted)
    except TypeError as exc:
        raise SolverError(f"solver {name!r}: bad options {options}: {exc}") from exc


def solve(costed: CostedGraph, solver: Solver) -> tuple[SolverResult, PlanEvaluation]:
    """Run ``solver`` on ``costed.problem()`` (timed) and evaluate its placement."""
    problem = costed.problem()
    t0 = time.perf_counter()
    result = solver.solve(problem)
    elapsed = time.perf_counter() - t0
    result = replace(result, solve_time_s=elapsed)
    logger.info("solver %s placed %d layers in %.3f s", solver.name, problem.num_layers, elapsed)
    return result, evaluate(costed, result.assignment)
