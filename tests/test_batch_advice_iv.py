"""Issue 34 (D5): the batch sizes the planner advises for a refused batch are accepted in turn.

``partition examples/mnist_mlp.py --gpus 4 --strategy hybrid --batch-size 2`` advised
``--batch-size 3``, and at 3 advised 2 or 4: a circle. The refusal of a batch no replica count
divides only checked that a replica count divides the advised batch, and the refusal of a batch
that cannot be micro-batched only that ``B - 1`` or ``B + 1`` has a divisor, ignoring the
replicas. The advice is now every batch near the refused one that the search's own rule accepts
(``accepted_replicas``: a replica count divides it and, for a pipeline or hybrid, its
per-replica share splits into micro-batches), and the search refuses by that same rule.

The grid is pure Python (a small costed chain, no tracing); one CLI run shows the advice works on
a traced model.
"""

from __future__ import annotations

import re

import pytest

from partitioner.cli.main import main
from partitioner.core.errors import InfeasibleError, UsageError
from partitioner.core.strategy import Family
from partitioner.planner.search import (
    StrategyOptions,
    StrategySearch,
    accepted_replicas,
    search_strategies,
)
from tests.planner.strategy_graphs import FAST_LINK, chain_costs, uniform_topology

FAMILIES = [
    *((f,) for f in Family),
    (Family.PIPELINE, Family.HYBRID),
    (Family.DATA_PARALLEL, Family.HYBRID),
]
LAYERS = 8


def _options(families: tuple[Family, ...]) -> StrategyOptions:
    return StrategyOptions(
        families=families, placement_solvers=("even",), refine=False, time_limit_s=30.0
    )


def _search(
    n_dev: int, batch: int, families: tuple[Family, ...], layers: int = LAYERS
) -> StrategySearch:
    chain = {"fwd_s": (1.0,) * layers, "weight_bytes": (100,) * layers, "act_bytes": 40}
    costs = chain_costs(32, topology=uniform_topology(n_dev, FAST_LINK), **chain)
    return search_strategies(costs, batch, _options(families))


def _advised(message: str) -> list[int]:
    """The batch sizes a refusal advises (``use batch_size=6 (2 replicas) or 8 (...)``)."""
    found = re.search(r"use batch_size=(.*), or strategy='auto'$", message)
    assert found is not None, message
    return [int(n) for n in re.findall(r"\d+", re.sub(r"\([^)]*\)", "", found.group(1)))]


def _refusals() -> list[tuple[tuple[Family, ...], int, int, str]]:
    """Every (families, devices, batch) of the grid the search refuses for its batch, with the
    refusal (a family that needs more devices than the grid's is refused for that instead)."""
    out = []
    for families in FAMILIES:
        for n_dev in range(2, 9):
            for batch in range(1, 41):
                if accepted_replicas(n_dev, batch, _options(families), LAYERS):
                    continue
                try:
                    _search(n_dev, batch, families)
                except UsageError as exc:
                    out.append((families, n_dev, batch, str(exc)))
                except InfeasibleError as exc:
                    assert "or more devices" in str(exc)
                else:
                    pytest.fail(f"{families} on {n_dev} devices: batch {batch} not refused")
    return out


def test_the_cli_case_is_refused_and_its_advice_is_not() -> None:
    hybrid = _options((Family.HYBRID,))
    assert accepted_replicas(4, 2, hybrid, 5) == ()
    assert accepted_replicas(4, 3, hybrid, 5) == ()
    assert accepted_replicas(4, 4, hybrid, 5) == (2,)
    with pytest.raises(UsageError) as info:
        _search(4, 2, (Family.HYBRID,), layers=5)
    assert str(info.value) == (
        "batch_size=2 cannot be split into equal micro-batches for strategy='hybrid' on 4 "
        "devices: 2 replicas get 1 sample each, too few to split into micro-batches "
        "(tf.distribute gives each replica an equal share; at most 4 micro-batches per stage): "
        "use batch_size=4 (2 replicas), or strategy='auto'"
    )
    with pytest.raises(UsageError) as info:
        _search(4, 3, (Family.HYBRID,), layers=5)
    assert _advised(str(info.value)) == [4]


def test_every_advised_batch_is_accepted_by_the_rule_the_search_refuses_by() -> None:
    refused = _refusals()
    assert len(refused) > 100  # hybrid and pipeline on every device count, data parallel at 1
    assert {f for f, _, _, _ in refused} >= {(Family.HYBRID,), (Family.PIPELINE,)}
    for families, n_dev, batch, message in refused:
        advised = _advised(message)
        assert advised, (families, n_dev, batch, message)
        for size in advised:
            why = (families, n_dev, batch, size, message)
            assert accepted_replicas(n_dev, size, _options(families), LAYERS), why


def test_every_advised_batch_plans() -> None:
    """The search itself, not only its rule: each advised batch is scored (a sample of the grid
    covering every family set and device count)."""
    advised: set[tuple[tuple[Family, ...], int, int]] = set()
    for families, n_dev, batch, message in _refusals():
        if batch <= 13:
            advised |= {(families, n_dev, size) for size in _advised(message)}
    assert {n for _, n, _ in advised} == set(range(2, 9))
    for families, n_dev, size in sorted(advised, key=str):
        found = _search(n_dev, size, families)
        assert {c.strategy.family for c in found.candidates} & set(families)


@pytest.mark.parametrize("n_dev", [2, 4, 8])
@pytest.mark.parametrize("families", FAMILIES, ids=lambda f: "+".join(x.value for x in f))
def test_the_rule_is_the_search(families: tuple[Family, ...], n_dev: int) -> None:
    """Unpruned, the search scores candidates with exactly the replica counts the rule accepts,
    and refuses exactly the batches it accepts none at."""
    for batch in (1, 2, 3, 5, 6, 7, 11, 12, 13, 17, 37):
        accepted = accepted_replicas(n_dev, batch, _options(families), LAYERS)
        if not accepted:  # refused for the batch, or hybrid for having 2 devices
            with pytest.raises((UsageError, InfeasibleError)):
                _search(n_dev, batch, families)
            continue
        chain = {"fwd_s": (1.0,) * LAYERS, "weight_bytes": (100,) * LAYERS, "act_bytes": 40}
        costs = chain_costs(32, topology=uniform_topology(n_dev, FAST_LINK), **chain)
        options = StrategyOptions(
            families=families, placement_solvers=("even",), refine=False, prune=False
        )
        found = search_strategies(costs, batch, options)
        assert {c.strategy.replicas for c in found.candidates} == set(accepted), batch


def test_the_cli_advice_for_a_hybrid_batch_of_2_on_4_gpus_runs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["examples/mnist_mlp.py", "--gpus", "4", "--strategy", "hybrid"]
    assert main([*argv, "--batch-size", "2"]) != 0
    err = capsys.readouterr().err
    advice = re.search(r"use --batch-size (\d+)", err)
    assert advice is not None, err
    assert advice.group(1) == "4"
    assert main([*argv, "--batch-size", advice.group(1)]) == 0
    assert "2 data-parallel replicas x 2 stages" in capsys.readouterr().out
