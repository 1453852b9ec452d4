"""Issue 34, campaign 34f: an error of the user's own code at a share of the batch (a micro-batch,
a replica's share) names that share and the flag that changes it, not a --batch-size never given
(D3); a subclassed model's shape error names the --input-shape it was traced with (D7); a Keras
Lambda layer is refused with advice that applies to it, Keras's hint cut at a sentence (D6); and
``auto`` on a model whose code refuses every share of the batch plans one device, not a slower
split, with advice that names no family the model refused (D2)."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import keras
import pytest

import partitioner
from partitioner.core.batching import BatchShare, at_share
from partitioner.core.errors import RewriteError, TraceError, quoting
from partitioner.core.strategy import Family
from partitioner.planner.search import StrategyOptions, search_strategies
from passes.checks import one_line
from tests.planner.strategy_graphs import FAST_LINK, chain_costs, uniform_topology
from tests.test_hostile_input_iii_paths import one_line_error, run_cli

LAYER = (
    "import keras\n\n"
    "class Exact8(keras.layers.Layer):\n"
    "    def call(self, x):\n"
    "        if x.shape[0] is not None and x.shape[0] != 8:\n"
    "            raise ValueError(f'Exact8 takes batches of exactly 8, got {x.shape[0]}')\n"
    "        return x\n"
    "    def compute_output_shape(self, s):\n"
    "        return s\n\n"
    "def build_model():\n"
    "    i = keras.Input((16,))\n"
    "    h = Exact8(name='exact8')(keras.layers.Dense(8, name='d1')(i))\n"
    "    return keras.Model(i, keras.layers.Dense(2, name='d2')(h), name='e8')\n"
)
SUBCLASSED = (
    "import keras\n\n"
    "class M(keras.Model):\n"
    "    def __init__(self, **kw):\n"
    "        super().__init__(**kw)\n"
    "        self.d1 = keras.layers.Dense(8, name='d1')\n"
    "        self.r = keras.layers.Reshape((3, 3), name='rs')\n"
    "    def call(self, x):\n"
    "        return self.r(self.d1(x))\n"
    "    def get_config(self):\n"
    "        return super().get_config()\n\n"
    "def build_model():\n"
    "    return M(name='sub')\n"
)


# -- D3: a share of the batch is named as the share, with the flag that changes it -------------


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (
            ["--pipeline", "--microbatches", "4", "--no-strategies"],
            [
                "got 2; it was traced at a micro-batch of 2 (--batch-size 8 over --microbatches 4)",
                "; change --microbatches or --batch-size so that a micro-batch suits the model",
            ],
        ),
        (
            ["--strategy", "data-parallel"],
            [
                "got 4; it was traced at a replica's share of 4 (--batch-size 8 over 2 "
                "data-parallel replicas); change --batch-size, the devices (--gpus) or --strategy",
            ],
        ),
    ],
    ids=["micro-batch", "replica-share"],
)
def test_an_error_at_a_share_of_the_batch_names_the_share_and_its_flag(
    flags: list[str], words: list[str], tmp_path: Path
) -> None:
    """Before: "it was traced at --batch-size 2" (and 4), though --batch-size 8 was given."""
    (tmp_path / "model.py").write_text(LAYER)
    proc = run_cli(["model.py", "--gpus", "2", "--batch-size", "8", *flags], cwd=tmp_path)
    line = one_line_error(proc, "layer 'exact8' (Exact8) of model 'e8' raised ValueError", *words)
    assert "traced at --batch-size" not in line


def test_at_share_rewords_only_the_trace_clause_and_keeps_the_quoted_text() -> None:
    said = "got 2 where batch_size=2 was expected"
    error = quoting(
        TraceError(f"layer 'g' raised ValueError: {said}; it was traced at batch_size=2"), said
    )
    hybrid = at_share(error, BatchShare(8, replicas=2, num_microbatches=2))
    assert str(hybrid).endswith(
        f"{said}; it was traced at a micro-batch of 2 (batch_size=8 over 2 replicas and 2 "
        "micro-batches each); change batch_size=, the devices (gpus=) or strategy= so that a "
        "micro-batch suits the model"
    )
    assert hybrid.quoted == (said,) and type(hybrid) is TraceError
    assert at_share(error, BatchShare(2)) is error  # the whole batch: as it was
    assert at_share(RewriteError("traced at batch_size=2"), BatchShare(8, 4)).args == (
        "traced at batch_size=2",
    )


# -- D7: a subclassed model's shape error names the --input-shape it was traced with ----------


def test_a_subclassed_models_shape_error_names_the_input_shape_flag(tmp_path: Path) -> None:
    """Before: "... target_shape=(3, 3); it was traced at --batch-size 8", --input-shape unnamed
    (a functional model got "with --input-shape ..." in the same situation)."""
    (tmp_path / "model.py").write_text(SUBCLASSED)
    proc = run_cli(
        ["model.py", "--gpus", "2", "--batch-size", "8", "--input-shape", "16", "--no-strategies"],
        cwd=tmp_path,
    )
    line = one_line_error(proc, "layer 'rs' (Reshape) of model 'sub' raised ValueError")
    assert line.endswith("; it was traced at --batch-size 8 with --input-shape 16"), line
    assert "input_shape=(8,), target_shape=(3, 3)" in line  # Keras's own words stay as they are


# -- D6: a Lambda layer is refused with advice that applies to it ------------------------------


def twice_plus_one(t: Any) -> Any:
    return t * 2.0 + 1.0


@pytest.mark.parametrize(
    ("function", "advice"),
    [
        (
            lambda t: t * 2.0 + 1.0,
            "a Python lambda has none: make it a named function decorated with "
            "@keras.saving.register_keras_serializable(), or write a custom layer",
        ),
        (
            twice_plus_one,
            "decorate twice_plus_one with @keras.saving.register_keras_serializable(), or write "
            "a custom layer",
        ),
    ],
    ids=["python-lambda", "named-function"],
)
def test_a_lambda_layer_is_refused_with_advice_that_applies(function: Any, advice: str) -> None:
    """Before: "pass **kwargs to super().__init__ and implement get_config", which the user
    cannot do to Keras's Lambda, after Keras's hint cut mid-word ("If you trust t...").
    Since issue 36 such a model is planned and placed in place; an emitted program, which
    cannot copy the layers from their configs, needs the model's file (model_source=) to make
    it: without one it is refused, with that advice."""
    from passes.rewrite.codegen import check_emittable

    inputs = keras.Input((16,))
    h = keras.layers.Lambda(function, name="lam")(keras.layers.Dense(8, name="d1")(inputs))
    model = keras.Model(inputs, keras.layers.Dense(2, name="d2")(h), name="lm")
    plan = partitioner.partition(model, gpus=2, batch_size=8, compare_strategies=False)
    assert plan.apply(model, devices=["/device:CPU:0", "/device:CPU:1"]) is model  # in place
    with pytest.raises(RewriteError) as info:
        check_emittable(model)
    message = str(info.value)
    assert "\n" not in message
    assert "layer 'lam' (Lambda) cannot be rebuilt from its config" in message
    assert advice in message and "or plan a model without it; pass model_source=" in message
    assert "super().__init__" not in message
    assert re.search(r"\w\.\.\.", message) is None, message  # never cut inside a word


def test_one_line_cuts_after_a_sentence_else_after_a_word() -> None:
    text = "First sentence here. Second one is rather longer than the first one. Third part."
    assert one_line(ValueError(text), 60) == "First sentence here. ..."
    assert one_line(ValueError(text), 200) == text
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda"
    assert one_line(ValueError(words), 30) == "alpha beta gamma delta..."


# -- D2: auto plans one device when the model refuses every share, and says so -----------------


class _Exact8(keras.layers.Layer):
    def call(self, x: Any) -> Any:
        if x.shape[0] is not None and x.shape[0] != 8:
            raise ValueError(f"Exact8 takes batches of exactly 8, got {x.shape[0]}")
        return x

    def compute_output_shape(self, shape: Any) -> Any:
        return shape


def _exact8_model() -> keras.Model:
    inputs = keras.Input((16,))
    h = _Exact8(name="exact8")(keras.layers.Dense(8, name="d1")(inputs))
    return keras.Model(inputs, keras.layers.Dense(2, name="d2")(h), name="e8")


def test_auto_plans_one_device_when_the_model_refuses_every_share_of_the_batch() -> None:
    """Before: "strategies not compared" and a plain split at 0.85x one device, exit 0, advising
    pipelining and data parallelism, which the model refuses."""
    plan = partitioner.partition(_exact8_model(), gpus=4, batch_size=8)
    assert plan.strategy is not None and plan.strategy.family is Family.SINGLE
    single = next(b for b in plan.baselines if b.solver == "single")
    assert single.step_time_s is not None and plan.step_time_s <= single.step_time_s
    note = next(n for n in plan.solver.notes if "not scored (" in n)
    assert "(data_parallel, pipeline, hybrid not compared): layer 'exact8'" in note
    assert "it was traced at a micro-batch of 4 (batch_size=8 over 2 micro-batches)" in note
    text = " ".join(plan.advice)
    assert (
        "--pipeline" not in text and "data_parallel" not in text and "MirroredStrategy" not in text
    )


def test_a_named_solvers_split_is_not_advised_families_the_model_refused() -> None:
    plan = partitioner.partition(_exact8_model(), gpus=4, batch_size=8, solver="metis")
    text = " ".join(plan.advice)
    assert "pipelining and data parallelism run (see the notes): train on one device." in text
    assert "--pipeline" not in text and "strategy='data_parallel' can use" not in text


def _failing_at(bad: set[int]) -> Any:
    """``costed_at`` of a 4-layer chain on 4 devices whose trace fails at the batches ``bad``."""
    costs = chain_costs(32, topology=uniform_topology(4, FAST_LINK), **_CHAIN)

    def costed_at(batch: int) -> Any:
        if batch in bad:
            raise TraceError(
                f"layer 'g' raised ValueError: no; it was traced at batch_size={batch}"
            )
        return costs(batch)

    return costed_at


_CHAIN: dict[str, Any] = {
    "fwd_s": (1.0, 1.0, 1.0, 1.0),
    "weight_bytes": (100,) * 4,
    "act_bytes": 40,
}


def test_the_search_leaves_out_only_the_shares_the_model_fails_at() -> None:
    """Pure Python: a failure at one micro-batch drops the candidates that need it, not the
    search (which before raised, so the plan applied the solver's split unchecked)."""
    search = search_strategies(_failing_at({4}), 32)
    families = {c.strategy.family for c in search.candidates}
    assert {Family.DATA_PARALLEL, Family.PIPELINE, Family.SINGLE} <= families
    assert all(
        32 // (c.strategy.replicas * c.strategy.num_microbatches) != 4 for c in search.candidates
    )
    assert search.refused == ()
    assert any(
        n.startswith("strategies on shares of the batch of 4 not scored: ") for n in search.notes
    )
    everything = search_strategies(_failing_at({16, 8, 4, 2, 1}), 32)
    assert everything.refused == (Family.DATA_PARALLEL, Family.PIPELINE, Family.HYBRID)
    assert everything.best.strategy.family in (Family.SINGLE, Family.PLACED)


def test_a_forced_family_the_model_refuses_raises_its_error_at_the_share() -> None:
    options = StrategyOptions(families=(Family.DATA_PARALLEL,))
    with pytest.raises(TraceError) as info:
        search_strategies(_failing_at({16, 8}), 32, options)
    assert str(info.value).startswith(
        "layer 'g' raised ValueError: no; it was traced at a replica's share of 16 (batch_size=32 "
        "over 2 data-parallel replicas); change batch_size="
    )


def test_the_command_lines_warnings_spell_the_flags_not_the_api() -> None:
    """The warning said "strategies not compared: ... batch_size=4" on the command line."""
    from partitioner.cli.main import _FLAG_SPELLING

    said = "got batch_size=4 from the model"
    error = quoting(TraceError(f"x raised: {said}; it was traced at batch_size=4"), said)
    record = logging.LogRecord(
        "partitioner.api",
        logging.WARNING,
        __file__,
        1,
        "strategies not compared: %s",
        (error,),
        None,
    )
    assert _FLAG_SPELLING.filter(record)
    assert (
        record.getMessage()
        == f"strategies not compared: x raised: {said}; it was traced at --batch-size 4"
    )
    foreign = logging.LogRecord("other", logging.WARNING, __file__, 1, "batch_size=4", (), None)
    assert _FLAG_SPELLING.filter(foreign) and foreign.getMessage() == "batch_size=4"


def test_the_replica_note_does_not_call_a_share_the_model_failed_at_scored() -> None:
    """Batch 30 on 4 devices: 4 replicas are ruled out by the batch, and 2 replicas' share (15)
    fails in the model's own code; the batch's note said "scored 1, 2 and 3" all the same."""
    search = search_strategies(_failing_at({15}), 30)
    note = next(n for n in search.notes if "replicas not scored: batch_size=30" in n)
    assert "; scored 1 and 3;" in note, note
    assert any(n.startswith("strategies on shares of the batch of 15") for n in search.notes)
