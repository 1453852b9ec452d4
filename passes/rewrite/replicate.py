"""Data-parallel replicas: ``R`` copies of a model (or of its pipeline) trained on shares of the
global batch, with the gradients averaged across the copies.

Two rewrites for the strategy families with ``R > 1`` (``passes.rewrite.device_placement`` and
``passes.rewrite.pipeline`` realise ``R = 1``; :func:`realise_strategy` chooses among all four
on this process's devices, :func:`passes.cluster.runtime.replicate_on_cluster` on a cluster's):

* :func:`replicate_model` (``R`` replicas x 1 stage) is TensorFlow's own data parallelism: a
  :class:`ReplicatedModel` whose variables are created under
  ``tf.distribute.MirroredStrategy(devices=replica_devices).scope()``, so each is a
  ``MirroredVariable`` with one copy per replica device. Keras's TensorFlow trainer then runs
  every step through ``strategy.run``: ``fit`` distributes its dataset with
  ``experimental_distribute_dataset`` (each replica gets ``global batch / R`` rows), each replica
  computes its loss scaled by ``1/R`` (``keras.src.losses.loss.scale_loss_for_distribution``),
  the optimizer all-reduces (sums) the gradients across replicas (``ReplicaContext.all_reduce``
  through ``tf.distribute.NcclAllReduce`` on GPUs, ``ReductionToOneDevice`` otherwise: the
  strategy's default collective ops number their groups per process, so a second strategy over
  other devices in the same process would fail) and
  ``MirroredVariable`` applies the same update to every copy (``extended.update``). For a loss that
  is a mean over the batch the summed, ``1/R``-scaled gradient is the global-batch gradient.
  ``train_on_batch`` is overridden to split its batch the same way (Keras's own would hand the
  whole batch to every replica).

* :func:`replicate_pipeline` (``R`` replicas x ``S`` stages, hybrid) builds ``R`` pipelined copies
  (:func:`passes.rewrite.pipeline.pipeline_model`, replica ``r``'s stage ``s`` on its own device)
  inside one :class:`ReplicatedPipeline`, whose ``train_step`` (one ``tf.function``) splits the
  global batch into ``R`` equal shares, runs each replica's pipelined forward and backward on its
  share (``PipelinedModel.pipeline_gradients``), averages every variable's gradient over the
  replicas and applies that one gradient to every replica's copy of the variable. With ``S = 1``
  it is data parallelism by the same explicit all-reduce: each replica is a
  :class:`PlacedReplica` (the placed copy on its one device, whose step returns its gradients).
  That is how data parallelism runs on a cluster's tasks: MirroredStrategy refuses another
  process's devices in eager mode ("In-graph multi-worker training ... is not supported").

  **Why not tf.distribute here.** MirroredStrategy creates each ``MirroredVariable``'s components
  on the strategy's devices, one per replica, whatever ``tf.device`` scope is in effect, and runs
  each replica's step under its one device: a replica spanning ``S`` devices, with each stage's
  variables on the stage's device, cannot be expressed (its variables would all sit on the
  replica's first device and every other stage would read them across devices every step). The
  cross-device reductions (``tf.distribute.CrossDeviceOps``) take ``PerReplica`` values, which only
  a strategy creates. The all-reduce is therefore explicit: every variable's ``R`` gradients are
  summed with one ``AddN`` on replica 0's device of that variable's stage, divided by ``R``, and
  that same tensor is read by every replica's update. TensorFlow copies a tensor to each consuming
  device byte for byte (``Send``/``Recv``), so every replica applies bitwise the same gradient and,
  with the same optimizer state, computes bitwise the same update: the copies stay identical.
  Each update runs on its variable's device (as in the placed model); the optimizer's step
  counter is advanced once per batch. This is a reduce-then-broadcast, not a ring: each non-root
  replica sends its gradient to the root (replica 0's device of the variable), the root sends
  the reduced one back; on a cluster those are gRPC transfers between the tasks.

  **Sparse gradients.** A gradient that reaches the all-reduce as a ``tf.IndexedSlices`` (an
  ``Embedding`` table's, in data parallelism) stays sparse, as TensorFlow's own
  ``cross_device_utils.aggregate_indexed_slices`` keeps it: on the root device the replicas'
  ``indices`` are concatenated, and their ``values`` concatenated and divided by ``R`` (not
  divided for a ``sum``-reduced loss), into one ``IndexedSlices`` of all the looked-up rows
  (repeated rows stay repeated; the optimizer's scatter adds them). So each non-root replica
  sends its slices (rows looked up x row width values, plus the indices) to the root, and the
  root sends the concatenation (``R`` times that) back to every other replica; each applies it; no
  dense table-sized tensor is made or sent. The pipeline rewrite sums a gradient over its
  micro-batches densely (``pipeline.py``), so in the hybrid an embedding's gradient arrives,
  and is reduced, dense.

For a mean-reduced loss (Keras's default), both rewrites compute the global-batch gradient up to
float rounding, so one step updates the weights as one device would on the whole batch (the tests
check <= 1e-5 relative with SGD). A ``sum``-reduced loss is summed across replicas (the hybrid) or
divided by ``R`` (Keras under MirroredStrategy does this; it is not the single-device step).
BatchNormalization normalises each replica's share with its own statistics, not the global
batch's; in the hybrid each replica also updates its own copy of the moving averages from its
share, so those non-trainable copies drift apart (the trainable ones stay identical): use
LayerNormalization to be exact. Random layers draw their masks per replica.

Bad input fails with one line (:class:`~partitioner.core.errors.RewriteError` or
:class:`~partitioner.core.errors.UsageError`): a global batch that ``R`` replicas (x ``M``
micro-batches) do not divide (before the step when the size is known, else by an in-graph
assertion that runs before any update), replica device lists of different lengths or layouts, a
device string TensorFlow does not know, a device in two replicas.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from partitioner.core.errors import RewriteError, UsageError
from partitioner.core.ir import Schedule
from passes.rewrite.device_placement import (
    PlacedModel,
    build_keeping_state,
    finish_copy,
    keep_output_names,
    place_model,
    sample_batch,
)
from passes.rewrite.pipeline import (
    PipelinedModel,
    PipelineGradients,
    SplitBatchTraining,
    assertion_errors,
    pipeline_model,
    split_structure,
    sum_gradients,
)
from passes.rewrite.saved_state import carry_assets, carry_model_state
from passes.weightless import is_weightless

logger = logging.getLogger(__name__)

__all__ = [
    "PlacedReplica",
    "ReplicatedModel",
    "ReplicatedPipeline",
    "batch_errors",
    "check_array_batches",
    "check_replica_devices",
    "default_cross_device_ops",
    "equal_shares",
    "realise_strategy",
    "reduce_then_clip",
    "replicate_model",
    "replicate_pipeline",
    "split_train_on_batch",
    "test_as_one_batch",
    "unequal_first_batch",
    "whole_batch_results",
]

_NOT_SPLIT = re.compile(r"global batch \d+ does not split[^\n\]\"']*")


# -- checks -----------------------------------------------------------------------------------


def _known_devices() -> dict[tuple[str, int], str]:
    """This process's logical devices, by (type, index)."""
    known: dict[tuple[str, int], str] = {}
    for d in tf.config.list_logical_devices():
        spec = tf.DeviceSpec.from_string(d.name)
        known[(str(spec.device_type).upper(), int(spec.device_index or 0))] = d.name
    return known


def check_replica_devices(devices: Sequence[str]) -> tuple[str, ...]:
    """``devices`` as local ``/device:TYPE:i`` strings; one-line error on an unknown or repeated
    device, or one of another process (MirroredStrategy runs on this process's devices only)."""
    known = _known_devices()
    seen: dict[tuple[str, int], str] = {}
    out: list[str] = []
    for name in devices:
        try:
            spec = tf.DeviceSpec.from_string(str(name))
        except (ValueError, TypeError) as exc:
            raise RewriteError(f"{name!r} is not a TensorFlow device string ({exc})") from None
        if spec.job not in (None, "localhost") or spec.task not in (None, 0):
            raise RewriteError(
                f"device {name!r} is on another process; replicas here run on this process's "
                "devices: apply the plan to a cluster's tasks (Plan.apply(model, cluster=...), "
                "each task serving with partition worker) for devices of other processes"
            )
        key = (str(spec.device_type or "").upper(), int(spec.device_index or 0))
        if spec.device_type is None or key not in known:
            raise RewriteError(
                f"device {name!r} is not one TensorFlow sees here; it sees {sorted(known.values())}"
            )
        if key in seen:
            raise RewriteError(
                f"device {name!r} is named twice ({seen[key]!r}); each replica and stage needs a "
                "device of its own"
            )
        seen[key] = str(name)
        out.append(f"/device:{key[0]}:{key[1]}")
    return tuple(out)


def _split_message(batch: int | str, replicas: int, microbatches: int = 1) -> str:
    parts = f"{replicas} replicas" + (
        f" x {microbatches} micro-batches" if microbatches > 1 else ""
    )
    unit = replicas * microbatches
    if isinstance(batch, int):
        low = batch // unit * unit
        valid = f"{low} or {low + unit}" if low else f"{unit}"
    else:
        valid = "{} or {}"
    return (
        f"global batch {batch} does not split into {parts}: use a batch size (and a dataset "
        f"length) that is a multiple of {unit}, e.g. {valid}"
    )


def _check_static_batch(batch: int, replicas: int, microbatches: int = 1) -> None:
    if batch % (replicas * microbatches):
        raise UsageError(_split_message(batch, replicas, microbatches))


def _batch_assertion(batch: Any, total: Any, replicas: int, microbatches: int) -> Any:
    """An in-graph check that ``total`` rows split into equal shares of ``batch`` rows each."""
    unit = replicas * microbatches
    low = total // unit * unit
    ok = tf.logical_and(tf.equal(batch * replicas, total), tf.equal(total % unit, 0))
    message = tf.strings.format(
        _split_message("{}", replicas, microbatches), (total, low, low + unit)
    )
    return tf.debugging.Assert(ok, [message])


def batch_errors() -> contextlib.AbstractContextManager[None]:
    """Turn the in-graph batch assertion into the one-line :class:`UsageError`."""
    return assertion_errors(_NOT_SPLIT)


def check_array_batches(x: Any, batch_size: Any, validation_split: Any, replicas: int) -> None:
    """For array inputs, the batch sizes ``fit`` will cut (the full ones and the last, partial
    one, after ``validation_split``) must each split into ``replicas`` equal shares."""
    from keras.src import tree

    leaves = [t for t in tree.flatten(x) if t is not None]
    if not leaves or not all(isinstance(t, (np.ndarray, tf.Tensor)) for t in leaves):
        return  # datasets and generators: the step's in-graph check
    rows = int(np.shape(leaves[0])[0])
    rows = int(np.floor(rows * (1.0 - float(validation_split or 0.0))))
    batch = int(batch_size or 32)
    for size in {min(batch, rows), rows % batch if rows > batch else 0} - {0}:
        _check_static_batch(size, replicas)


def _first_leaf(x: Any) -> Any:
    from keras.src import tree

    leaves = [t for t in tree.flatten(x) if t is not None]
    if not leaves:
        raise RewriteError("replicated training needs input data (x is empty)")
    return leaves[0]


# -- R replicas x 1 stage: MirroredStrategy ---------------------------------------------------


class ReplicatedModel(keras.Model):
    """A model trained data-parallel by ``tf.distribute.MirroredStrategy``; see the module
    docstring. Create it inside the strategy's scope (:func:`replicate_model` does)."""

    def __init__(self, inner: keras.Model, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.inner = inner

    @property
    def num_replicas(self) -> int:
        return int(self.distribute_strategy.num_replicas_in_sync)

    @property
    def replica_devices(self) -> tuple[str, ...]:
        return tuple(self.distribute_strategy.extended.worker_devices)

    def call(self, inputs: Any, training: bool | None = None) -> Any:
        return self.inner(inputs, training=training)

    def compile(self, optimizer: Any = "rmsprop", *args: Any, **kwargs: Any) -> None:
        """Keras ``compile`` inside the strategy's scope, so that the optimizer's variables are
        mirrored too. Keras's TensorFlow optimizer binds the strategy it was created under; one
        made outside this scope is re-made from its config inside it. Keras's arguments after
        the optimizer (``loss``, ``loss_weights``, ...) may be given by position, as Keras takes
        them (``compile("sgd", "mse")`` was a TypeError, campaign 34ah)."""
        names = inspect.signature(keras.Model.compile).parameters
        after = [n for n in names if n not in ("self", "optimizer", "kwargs")]
        if len(args) > len(after):
            raise TypeError(f"compile() takes at most {len(after) + 1} positional arguments")
        for name, value in zip(after, args):
            if name in kwargs:
                raise TypeError(f"compile() got multiple values for argument {name!r}")
            kwargs[name] = value
        with self.distribute_strategy.scope():
            if isinstance(optimizer, keras.optimizers.Optimizer) and (
                getattr(optimizer, "_distribution_strategy", None) is not self.distribute_strategy
            ):
                optimizer = optimizer.__class__.from_config(optimizer.get_config())
            super().compile(optimizer=optimizer, **kwargs)
        reduce_then_clip(self.optimizer)

    def train_step(self, data: Any) -> Any:
        """Keras's step, after checking (in the graph, before any update) that every replica
        got the same number of rows (:func:`equal_shares`); its logs the whole batch's
        (:func:`whole_batch_results`)."""
        shares = equal_shares(data, self.num_replicas)
        return whole_batch_results(self, super().train_step(shares), shares)

    def test_step(self, data: Any) -> Any:
        """Keras's step, its logs the whole batch's (:func:`whole_batch_results`)."""
        return whole_batch_results(self, super().test_step(data), data)

    def fit(self, x: Any = None, y: Any = None, *args: Any, **kwargs: Any) -> Any:
        """Keras ``fit``; arrays whose batches ``R`` does not divide are refused up front."""
        batch_size = args[0] if args else kwargs.get("batch_size")
        check_array_batches(x, batch_size, kwargs.get("validation_split"), self.num_replicas)
        with batch_errors():
            return super().fit(x, y, *args, **kwargs)

    def _maybe_symbolic_build(self, iterator: Any = None, data_batch: Any = None) -> Any:
        """Keras builds the model from the first batch averaged over the replicas, which fails
        on unequal shares before the step's own check could run: say so in one line."""
        with unequal_first_batch(self.num_replicas, self.distribute_strategy):
            return super()._maybe_symbolic_build(iterator=iterator, data_batch=data_batch)

    def train_on_batch(
        self,
        x: Any,
        y: Any = None,
        sample_weight: Any = None,
        class_weight: Any = None,
        return_dict: bool = False,
    ) -> Any:
        """One step on ``x``, split into ``R`` equal shares, one per replica
        (:func:`split_train_on_batch`)."""
        return split_train_on_batch(
            self, self.num_replicas, x, y, sample_weight, class_weight, return_dict
        )

    def test_on_batch(
        self, x: Any, y: Any = None, sample_weight: Any = None, return_dict: bool = False
    ) -> Any:
        """``evaluate`` of ``x`` as one batch, a share per replica: Keras's gives every replica
        the whole batch, counting each sample ``R`` times (campaign 34ae)."""
        return test_as_one_batch(self, x, y, sample_weight, return_dict)

    def predict_on_batch(self, x: Any) -> Any:
        """``predict`` of ``x`` as one batch, a share per replica: Keras's gives every replica
        the whole batch and returns ``R`` times the rows (campaign 34z)."""
        return self.predict(x, batch_size=int(np.shape(_first_leaf(x))[0]), verbose=0)


def equal_shares(data: Any, replicas: int) -> Any:
    """``data`` (a replica's share of a step's batch, in the step's own structure) behind an
    in-graph check that every replica got the same number of rows: tf.distribute splits a batch
    that ``replicas`` does not divide unevenly, which would weight the replicas' losses wrongly."""
    from keras.src import tree

    x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
    batch = tf.shape(_first_leaf(x))[0]
    total = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, batch)
    check = _batch_assertion(batch, total, replicas, 1)
    with tf.control_dependencies([check]):
        return tree.map_structure(lambda t: tf.identity(t) if isinstance(t, tf.Tensor) else t, data)


@contextlib.contextmanager
def unequal_first_batch(replicas: int, strategy: Any) -> Iterator[None]:
    """Keras's symbolic build of a replicated model averages the first batch over the replicas
    (``strategy.reduce``), which fails on unequal shares before the step's own check could run:
    one line instead. A batch holding strings or bools (which no mean takes: TensorFlow's
    ``AddN`` error for a ``StringLookup`` model's first ``fit``, campaign 34ag; a bool mask,
    34aj) is built from the first replica's share instead, of the shapes and dtypes the mean
    would have."""
    from keras.src import tree

    reduce = strategy.reduce

    def first_share_of_strings(reduce_op: Any, value: Any, axis: Any = None) -> Any:
        shares = tree.map_structure(lambda v: strategy.experimental_local_results(v)[0], value)
        if any(not _averageable(getattr(t, "dtype", None)) for t in tree.flatten(shares)):
            return shares
        return reduce(reduce_op, value, axis=axis)

    strategy.reduce = first_share_of_strings
    try:
        yield
    except tf.errors.InvalidArgumentError as exc:
        if "must have the same size and shape" not in str(exc):
            raise
        shapes = re.findall(r"input \d+: \[(\d+)", str(exc), flags=re.IGNORECASE)
        raise UsageError(
            f"the first batch does not split into {replicas} equal replica shares "
            f"(shares of {' and '.join(shapes) or 'unequal'} rows): use a batch size (and a "
            f"dataset length) that is a multiple of {replicas}"
        ) from None
    finally:
        del strategy.reduce  # the class's own again


def _averageable(dtype: Any) -> bool:
    """Whether a mean over the replicas takes values of ``dtype``: numbers do; strings and
    bools (a mask input: TensorFlow's ``AddN`` error, campaign 34aj) do not."""
    dtype = tf.as_dtype(dtype) if dtype is not None else None
    return dtype is None or dtype.is_floating or dtype.is_integer or dtype.is_complex


def split_train_on_batch(
    model: keras.Model,
    replicas: int,
    x: Any,
    y: Any = None,
    sample_weight: Any = None,
    class_weight: Any = None,
    return_dict: bool = False,
) -> Any:
    """``model.train_on_batch`` under its ``MirroredStrategy``, ``x`` split into ``replicas``
    equal shares, one per replica: Keras's own passes the whole batch to every replica. Each
    share is cut out and placed on its device by
    ``strategy.experimental_distribute_values_from_function``."""
    from keras.src import tree
    from keras.src.trainers.data_adapters import data_adapter_utils
    from keras.src.utils.python_utils import pythonify_logs

    model._assert_compile_called("train_on_batch")
    if class_weight is not None:
        sample_weight = data_adapter_utils.class_weight_to_sample_weights(y, class_weight)
    batch = int(np.shape(_first_leaf(x))[0])
    _check_static_batch(batch, replicas)
    data = keras.utils.pack_x_y_sample_weight(x, y, sample_weight)
    share = batch // replicas

    def shard(context: Any) -> Any:
        r = context.replica_id_in_sync_group
        return tree.map_structure(
            lambda t: tf.convert_to_tensor(t)[r * share : (r + 1) * share], data
        )

    distributed = model.distribute_strategy.experimental_distribute_values_from_function(shard)
    # As tensors: Keras's symbolic build reads a numpy array's dtype, and numpy's ``object``
    # (a string input) is no Keras dtype while ``tf.string`` is.
    model._maybe_symbolic_build(
        data_batch=tree.map_structure(
            lambda t: None if t is None else tf.convert_to_tensor(t), (x, y, sample_weight)
        )
    )
    model.make_train_function()
    model.reset_metrics()
    with batch_errors():
        logs = pythonify_logs(model.train_function(iter([distributed])))
    return logs if return_dict else model._flatten_metrics_in_order(logs)


def test_as_one_batch(
    model: keras.Model, x: Any, y: Any, sample_weight: Any, return_dict: bool
) -> Any:
    """``test_on_batch`` of a replicated model: ``evaluate`` of the batch in one step, which
    gives each replica its share and returns what ``test_on_batch`` returns."""
    rows = int(np.shape(_first_leaf(x))[0])
    return model.evaluate(
        x, y, sample_weight=sample_weight, batch_size=rows, verbose=0, return_dict=return_dict
    )


def whole_batch_results(model: keras.Model, logs: Any, data: Any = None) -> Any:
    """In a replica's step: each value of the ``logs`` it returned that *is* a metric's result
    (the same ops on the same variables as the metric's ``result()``, :func:`_signature`, under
    any key) read from that metric across the replicas (a merge, which every replica reaches),
    so that each batch's logs (callbacks', the progress bar's, ``train_on_batch``'s, and an
    epoch's, which Keras takes from the last step's) are the whole batch's: Keras averaged the
    replicas' own results (an RMSE or an AUC is no mean of its shares' values: 0.27 for 0.47,
    campaigns 34ab, 34ac; keras.io's VAE logs its ``total_loss`` tracker as ``loss``, 34ad).
    Any other value (the step's own batch loss, ``1 - accuracy``, a sum of two metrics) is
    kept, and averaged over the replicas as tf.distribute does (campaign 34ae); so are logs
    outside a replica. A kept value that reads a metric's variables (its ``count`` itself,
    ``count * 1.0``) is not one device's, as every replica updates the metric: a NOT EXACT
    warning names it (campaign 34ag: a count 4 times one device's), and so is a value with as
    many rows as the replica's share ``data`` (:func:`_warn_per_sample`)."""
    context = tf.distribute.get_replica_context()
    if not isinstance(logs, dict) or context is None or tf.distribute.in_cross_replica_context():
        return logs
    owners = _variable_owners(model)
    by_name = _flat(model.get_metrics_result())
    chosen: dict[str, Any] = {}
    state: list[str] = []
    for key, value in _flat(logs).items():
        read = _state_read(_as_tensor(value))
        if not read:
            continue
        source = _metric_result_of(value, read, owners, by_name.get(key), key)
        if source is not None:
            chosen[key] = source
        elif any(handle in owners for handle in read):
            state.append(key)
    _warn_state_logged(model, state)
    _warn_per_sample(model, logs, data, set(chosen))
    if not chosen:
        return logs
    return _with_leaves(logs, context.merge_call(lambda _: _results_of(model, chosen)))


def _warn_per_sample(model: keras.Model, logs: Any, data: Any, kept: set[str]) -> None:
    """The NOT EXACT warning for each logged value computed from the batch with as many rows as
    the replica's share ``data`` (or rows unknown until it runs): Keras averages the replicas'
    values element by element, which is one device's value for a value the step reduced over
    its batch (a column mean) but not for one row per sample (a per-sample loss: 4 rows for a
    batch of 8, each the mean of two unrelated samples, campaign 34ai). Gathering such values
    instead took column means for rows (34aj): their shape alone does not say which they are.
    Values in ``kept`` (metrics' results) are left."""
    if data is None:
        return
    x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
    rows = getattr(_first_leaf(x), "shape", None)
    share = rows[0] if rows is not None and len(rows) else None
    keys = []
    for key, value in _flat(logs).items():
        shape = getattr(value, "shape", None)
        if key in kept or not isinstance(value, tf.Tensor) or shape is None or not shape.rank:
            continue
        if (shape[0] is None or shape[0] == share) and _state_read(value) is None:
            keys.append(key)
    new = _not_yet_warned(model, "_partitioner_row_logs_warned", keys)
    if new:
        logger.warning(
            "NOT EXACT: the step's logs %s have a row per sample of a replica's share, or a "
            "value the step reduced over its batch of as many entries: Keras averages the "
            "replicas' values entry by entry, which is one device's value for the latter, but "
            "not for one row per sample (each entry then averages %d unrelated samples); "
            "reduce it over the batch in the step, or log it outside fit",
            ", ".join(repr(k) for k in new), len(model.distribute_strategy.extended.worker_devices),
        )  # fmt: skip


def _not_yet_warned(model: keras.Model, attribute: str, keys: Sequence[str]) -> list[str]:
    """Of ``keys``, those not warned about yet on ``model`` (recorded in its ``attribute``,
    outside Keras's tracking), now recorded: every replica's step traces the same logs."""
    warned: set[str] = vars(model).setdefault(attribute, set())
    new = [key for key in keys if key not in warned]
    warned.update(new)
    return new


def _warn_state_logged(model: keras.Model, keys: Sequence[str]) -> None:
    """The NOT EXACT warning for logged ``keys`` reading a metric's variables, once a model and
    key (every replica's step traces the same logs)."""
    new = _not_yet_warned(model, "_partitioner_state_logs_warned", keys)
    if not new:
        return
    replicas = len(model.distribute_strategy.extended.worker_devices)  # in place: "1 in sync"
    logger.warning(
        "NOT EXACT: the step's logs %s read a metric's variables but are not its result(): "
        "each of the %d replicas updates the metric, so they are not one device's (a count is "
        "%d times one device's); log the metric's result() instead",
        ", ".join(repr(k) for k in new), replicas, replicas,
    )  # fmt: skip


def _as_tensor(value: Any) -> Any:
    """A logged variable (a metric's ``count`` itself) as a read of it in this graph; any other
    value as it is."""
    if isinstance(value, (keras.Variable, tf.Variable)):
        return tf.identity(getattr(value, "value", value))
    return value


def _metric_result_of(
    value: Any, read: Sequence[str], owners: Mapping[str, Any], named: Any, key: str
) -> Any:
    """The metric (or the name of the metric result ``named`` under ``key``) whose ``result()``
    the logged ``value``, reading the variables ``read``, is; None if none is."""
    metrics = {owners.get(handle) for handle in read}
    candidates: list[tuple[Any, Any]] = []
    metric: Any = next(iter(metrics)) if len(metrics) == 1 else None
    if metric is not None:
        candidates.append((metric, metric.result()))
    if named is not None:
        candidates.append((key, named))
    mine = _signature(value)
    for source, result in candidates:
        if not isinstance(result, dict) and _signature(result) == mine:
            return source
    return None


def _signature(value: Any, limit: int = 5000) -> Any:
    """The ops that compute the graph tensor ``value`` from variables and constants, as a
    nested tuple: a variable read by the handle it reads, a constant by its value."""
    memo: dict[tuple[str, int], Any] = {}

    def of(tensor: Any) -> Any:
        op, key = tensor.op, (tensor.op.name, tensor.value_index)
        if key not in memo:
            if len(memo) > limit:
                raise RecursionError("too many ops")
            if op.type == "ReadVariableOp":
                memo[key] = ("read", op.inputs[0].name)
            elif op.type == "Const":
                memo[key] = ("const", op.get_attr("value").SerializeToString())
            else:
                memo[key] = (op.type, tensor.value_index, tuple(of(t) for t in op.inputs))
        return memo[key]

    try:
        return of(value)
    except (RecursionError, AttributeError, ValueError):
        return object()  # equal to nothing


def _variable_owners(model: keras.Model) -> dict[str, Any]:
    """The metric of each variable of ``model``'s metrics, by the name of the handle this graph
    reads it through (its capture in the step's graph)."""
    graph = tf.compat.v1.get_default_graph()
    captured = {id(outer): inner for outer, inner in getattr(graph, "captures", ())}
    owners: dict[str, Any] = {}
    for metric in model.metrics:
        for variable in getattr(metric, "variables", ()):
            value = getattr(variable, "value", variable)
            for part in getattr(value, "values", None) or (value,):
                handle = getattr(part, "handle", None)
                inner = captured.get(id(handle))
                if inner is not None:
                    owners[inner.name] = metric
    return owners


def _results_of(model: keras.Model, chosen: Mapping[str, Any]) -> dict[str, Any]:
    """Across the replicas: the metrics' results by name, and the chosen metrics' own."""
    by_name = _flat(model.get_metrics_result())
    read = {}
    for key, source in chosen.items():
        result = by_name[source] if isinstance(source, str) else source.result()
        read[key] = tf.identity(result)
    return read


def _flat(logs: Mapping[str, Any]) -> dict[str, Any]:
    """``logs`` flattened as Keras's logs are (a nested dict's own keys); the items of a list
    or tuple under ``key`` as ``key[0]``, ``key[1]``, ... (a metric's result logged in a list
    was missed, campaign 34al)."""
    flat: dict[str, Any] = {}
    for key, value in logs.items():
        flat.update(_flat(value) if isinstance(value, Mapping) else _items(key, value))
    return flat


def _items(key: str, value: Any) -> dict[str, Any]:
    if isinstance(value, (list, tuple)):
        return {k: v for i, item in enumerate(value) for k, v in _items(f"{key}[{i}]", item).items()}
    return {key: value}


def _with_leaves(logs: Mapping[str, Any], leaves: Mapping[str, Any]) -> dict[str, Any]:
    """``logs`` with the values of ``leaves`` in place of those of their keys (as
    :func:`_flat` names them), nesting kept."""
    return {
        key: _with_leaves(value, leaves) if isinstance(value, Mapping) else _put(key, value, leaves)
        for key, value in logs.items()
    }


def _put(key: str, value: Any, leaves: Mapping[str, Any]) -> Any:
    if isinstance(value, (list, tuple)):
        return type(value)(_put(f"{key}[{i}]", item, leaves) for i, item in enumerate(value))
    return leaves.get(key, value)


_DATA_SOURCES = ("Placeholder", "IteratorGetNext", "OptionalGetValue", "MultiDeviceIterator")
"""Ops a step's batch comes from (its arguments, the dataset's iterator)."""


def _state_read(value: Any, limit: int = 5000) -> list[str] | None:
    """The resource handles (by name) the graph tensor ``value`` reads variables through, when it
    is computed from variables and constants alone (a metric's ``result()``), not from the
    step's batch: its inputs, followed back to each ``ReadVariableOp`` or constant, never reach
    a source of data (:data:`_DATA_SOURCES`) or another op without inputs. None otherwise (an
    eager value, a graph past ``limit`` ops)."""
    op = getattr(value, "op", None)
    if op is None or not hasattr(op, "inputs"):
        return None
    seen: set[str] = set()
    handles: list[str] = []
    stack = [op]
    while stack:
        op = stack.pop()
        if op.name in seen or op.type == "Const":
            continue
        seen.add(op.name)
        if op.type == "ReadVariableOp":
            handles.append(op.inputs[0].name)
            continue
        if len(seen) > limit or not op.inputs or op.type.startswith(_DATA_SOURCES):
            return None
        stack += [t.op for t in op.inputs]
    return handles


def reduce_then_clip(optimizer: Any, scale: float = 1.0) -> None:
    """``optimizer`` (bound to a ``MirroredStrategy``) clips the replicas' all-reduced gradient,
    as one device clips the whole batch's, rather than each replica's share: Keras clips
    (``clipnorm``, ``clipvalue``, ``global_clipnorm``) before its all-reduce, which gave other
    weights than one device (campaign 34y). The all-reduced gradients are multiplied by
    ``scale`` first (``1/R``: their mean, for replicas whose losses are not scaled; 1 for
    Keras's own scaled losses). Refused in one line: what Keras's optimizers cannot run in a
    replica (an exponential moving average, gradient accumulation: a TensorFlow traceback at
    the first step)."""
    made = getattr(optimizer, "inner_optimizer", None) or optimizer  # a LossScaleOptimizer's
    for option, asked in (
        ("use_ema=True", made.use_ema),
        (
            f"gradient_accumulation_steps={made.gradient_accumulation_steps}",
            made.gradient_accumulation_steps,
        ),
    ):
        if asked:
            raise RewriteError(
                f"optimizer {made.name!r} has {option}, which Keras's optimizers do not run in "
                "tf.distribute replicas; train without it, or plan with strategy='placed' or "
                "strategy='single'"
            )
    if getattr(made, "_partitioner_reduces", False):
        return
    summed, clip = made._all_reduce_sum_gradients, made._clip_gradients

    def in_replica() -> bool:
        return tf.distribute.has_strategy() and tf.distribute.get_replica_context() is not None

    def reduced(grads_and_vars: Any) -> Any:
        pairs = summed(grads_and_vars)
        if not in_replica():
            return pairs
        grads = clip([_scaled(g, scale) for g, _ in pairs])
        return list(zip(grads, [v for _, v in pairs]))

    def clipped(grads: Any) -> Any:
        return list(grads) if in_replica() else clip(grads)

    made._all_reduce_sum_gradients, made._clip_gradients = reduced, clipped
    made._partitioner_reduces = True


def _scaled(gradient: Any, scale: float) -> Any:
    if gradient is None or scale == 1.0:
        return gradient
    if isinstance(gradient, tf.IndexedSlices):  # an Embedding's: its rows, kept sparse
        values = gradient.values * tf.cast(scale, gradient.values.dtype)
        return tf.IndexedSlices(values, gradient.indices, gradient.dense_shape)
    return gradient * tf.cast(scale, gradient.dtype)


def _copy_in_scope(model: keras.Model, sample_inputs: Sequence[Any]) -> keras.Model:
    """A fresh copy of ``model`` (variables created in the current scope) with its weights."""
    try:
        if isinstance(model, keras.Sequential) or _is_functional(model):
            copy = keras.models.clone_model(model)
        else:
            copy = model.__class__.from_config(model.get_config())
        carry_assets(copy, model, model.name)  # a lookup's vocabulary, before the first call
        copy(sample_batch(sample_inputs, model), training=False)
    except RewriteError:
        raise
    except Exception as exc:
        raise RewriteError(
            f"could not copy model {model.name!r} for replication: {type(exc).__name__}: {exc}; "
            "implement get_config/from_config"
        ) from exc
    if [tuple(w.shape) for w in copy.weights] != [tuple(w.shape) for w in model.weights]:
        raise RewriteError(
            f"the copy of {model.name!r} has other weights than the original "
            f"({len(copy.weights)} vs {len(model.weights)}); implement get_config/from_config"
        )
    if not is_weightless(model):  # else the copy's fresh weights, made in this scope, stay
        copy.set_weights(model.get_weights())
    carry_model_state(copy, model, assets=False)  # what set_weights leaves out (adapt()'s mean)
    return copy


def _is_functional(model: Any) -> bool:
    from keras.src.models.functional import Functional

    return isinstance(model, Functional)


def default_cross_device_ops(devices: Sequence[str]) -> Any:
    """NCCL all-reduce for GPUs, a reduction to the first device otherwise.

    Left to itself, MirroredStrategy uses collective ops whose group keys every strategy numbers
    from 1 in the process; a second strategy over other devices then fails with "is joining a
    group that is already full". These two implementations keep no such process-wide state.
    """
    if all("GPU" in d.upper() for d in devices):
        return tf.distribute.NcclAllReduce()
    return tf.distribute.ReductionToOneDevice(reduce_to_device=devices[0])


def replicate_model(
    model: keras.Model,
    replica_devices: Sequence[str],
    sample_inputs: Sequence[Any],
    *,
    cross_device_ops: tf.distribute.CrossDeviceOps | None = None,
) -> ReplicatedModel:
    """A copy of ``model`` trained data-parallel on ``replica_devices`` (one replica each).

    The copy's variables are ``MirroredVariable``\\ s of
    ``tf.distribute.MirroredStrategy(devices=replica_devices)`` holding the original's values, and
    it is compiled with the original's compile config (when the original is compiled) under the
    strategy's scope; ``fit``, ``train_on_batch``, ``evaluate`` and ``predict`` split each global
    batch across the replicas. ``sample_inputs`` (one array per model input) builds the copy. The
    original model is never modified. XLA is turned off, as for the placed model.
    ``cross_device_ops`` overrides the all-reduce (default: :func:`default_cross_device_ops`).
    """
    devices = check_replica_devices(replica_devices)
    if len(devices) < 2:
        raise UsageError(
            f"data parallelism needs >= 2 replica devices, got {list(replica_devices)}; use "
            "place_model for one device"
        )
    strategy = tf.distribute.MirroredStrategy(
        devices=list(devices),
        cross_device_ops=cross_device_ops or default_cross_device_ops(devices),
    )
    with strategy.scope():
        inner = _copy_in_scope(model, sample_inputs)
        replicated = ReplicatedModel(inner, name=f"{model.name}_replicated")
        build_keeping_state(replicated, sample_batch(sample_inputs, model))
        keep_output_names(replicated, model)
        if model.compiled:
            try:
                config = model.get_compile_config()
                from keras.src.saving import serialization_lib

                kwargs = serialization_lib.deserialize_keras_object(config)
                kwargs["jit_compile"] = False
                replicated.compile(**kwargs)
                replicated.optimizer.build(replicated.trainable_variables)
            except RewriteError:  # an optimizer replicas cannot run (reduce_then_clip)
                raise
            except Exception as exc:
                logger.warning("could not copy the compile settings (%s); call compile()", exc)
    return replicated


# -- R replicas x S stages: explicit all-reduce -----------------------------------------------


class PlacedReplica(PlacedModel):
    """One replica of data parallelism under the explicit all-reduce: the placed copy of the
    model on its one device, whose :meth:`pipeline_gradients` computes a step's loss, outputs
    and gradients as the placed step does (``tf.gradients``: an ``Embedding``'s gradient stays a
    ``tf.IndexedSlices``) without applying them. It speaks the part of
    :class:`~passes.rewrite.pipeline.PipelinedModel` a :class:`ReplicatedPipeline` uses."""

    num_microbatches = 1
    warnings: tuple[str, ...] = ()

    @property
    def stage_devices(self) -> tuple[str, ...]:
        """The replica's one device (its one stage)."""
        return tuple(dict.fromkeys(self.layer_devices.values()))

    def pipeline_gradients(
        self, x: Any, y: Any = None, sample_weight: Any = None
    ) -> PipelineGradients:
        """The batch loss, outputs and gradients (``None`` where unused); inside a
        ``tf.function`` only, as for the pipeline."""
        if tf.executing_eagerly():
            raise RewriteError(
                "replicated training builds a graph (tf.gradients); do not compile with "
                "run_eagerly=True, and call pipeline_gradients inside tf.function"
            )
        y_pred = self(x, training=True)
        with tf.device(self.output_device):
            loss = self._compute_loss(
                x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
            )
        scaled = loss if self.optimizer is None else self.optimizer.scale_loss(loss)
        return PipelineGradients(loss, y_pred, tuple(self.gradients(scaled)))


def _placed_replica(
    model: keras.Model, layer_devices: Mapping[str, str], sample_inputs: Sequence[Any]
) -> PlacedReplica:
    """The :class:`PlacedReplica` of ``model`` with every layer on its one device."""
    placed = place_model(model, layer_devices, sample_inputs)
    replica = PlacedReplica(placed.inner, placed.layer_devices, name=f"{model.name}_replica")
    finish_copy(replica, model, sample_inputs, logger)
    return replica


class ReplicatedPipeline(SplitBatchTraining):
    """``R`` pipelined copies of one model (or, with one stage, :class:`PlacedReplica` copies)
    trained on shares of each batch with averaged gradients; see the module docstring (built by
    :func:`replicate_pipeline`)."""

    def __init__(self, replicas: Sequence[PipelinedModel | PlacedReplica], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if len(replicas) < 2:
            raise UsageError(f"a replicated pipeline needs >= 2 replicas, got {len(replicas)}")
        self.replicas = list(replicas)

    def _batch_errors(self) -> contextlib.AbstractContextManager[None]:
        """Catches the error of this step's assertion that the batch splits into the replicas'
        micro-batches (``fit`` and ``train_on_batch`` are :class:`SplitBatchTraining`'s)."""
        return batch_errors()

    @property
    def num_replicas(self) -> int:
        return len(self.replicas)

    @property
    def num_microbatches(self) -> int:
        return int(self.replicas[0].num_microbatches)

    @property
    def stage_devices(self) -> tuple[tuple[str, ...], ...]:
        """``stage_devices[r][s]``: the device of replica ``r``'s stage ``s``."""
        return tuple(tuple(r.stage_devices) for r in self.replicas)

    @property
    def warnings(self) -> tuple[str, ...]:
        return tuple(self.replicas[0].warnings)

    @property
    def losses(self) -> list[Any]:
        """The replicas' added losses, averaged (the copies' weight regularizers are equal)."""
        per_replica = [r.losses for r in self.replicas]
        if not any(per_replica):
            return []
        total = [tf.add_n(list(losses)) for losses in per_replica if losses]
        return [tf.add_n(total) / float(len(total))]

    def call(self, inputs: Any, training: bool | None = None) -> Any:
        """Each replica runs its share of the rows (shares differ by at most one row)."""
        from keras.src import tree

        n = self.num_replicas
        rows = tf.shape(_first_leaf(inputs))[0]
        sizes = tf.stack([rows // n + tf.cast(r < rows % n, rows.dtype) for r in range(n)])
        leaves = tree.flatten(inputs)
        parts = [None if t is None else tf.split(t, sizes, num=n) for t in leaves]
        outputs = []
        for r, replica in enumerate(self.replicas):
            share = tree.pack_sequence_as(inputs, [None if p is None else p[r] for p in parts])
            outputs.append(replica(share, training=training))
        with tf.device(self.replicas[0].output_device):
            return _concat(outputs)

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """Keras ``compile`` with XLA off, each variable's update on its own device, and the
        replicas compiled with the same loss (they compute it on their shares)."""
        if kwargs.get("jit_compile") not in (None, False, "auto"):
            logger.warning("jit_compile is turned off: XLA would ignore the device placement")
        kwargs["jit_compile"] = False
        super().compile(*args, **kwargs)
        if isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer):
            raise RewriteError(
                "a LossScaleOptimizer is not supported by the replicated pipeline: the replicas "
                "scale their losses separately; use float32 training or one replica"
            )
        for replica in self.replicas:
            replica.compile(
                loss=self.loss, loss_weights=kwargs.get("loss_weights"), jit_compile=False
            )
        _place_updates(self.optimizer)

    def compile_from_config(self, config: Any) -> None:
        """Compile from a ``get_compile_config()`` dict (Keras's own ignores overridden
        ``compile``)."""
        from keras.src.saving import serialization_lib

        self.compile(**serialization_lib.deserialize_keras_object(config))
        if self.optimizer is not None and self.built:
            self.optimizer.build(self.trainable_variables)

    def train_step(self, data: Any) -> Any:
        from keras.src.losses import loss as loss_module

        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        xs, ys, sws, rows = self._shard_batch(x, y, sample_weight)
        results = [
            replica.pipeline_gradients(xs[r], ys[r], sws[r])
            for r, replica in enumerate(self.replicas)
        ]
        divisor = self._divisor()
        with tf.device(self.replicas[0].output_device):
            loss = sum_gradients([res.loss for res in results], divisor)
            y_pred = _concat([res.y_pred for res in results])
        self._loss_tracker.update_state(
            loss_module.unscale_loss_for_distribution(loss), sample_weight=rows
        )
        if self.trainable_weights:
            self._apply_gradients(self._all_reduce([res.gradients for res in results], divisor))
        with tf.device(self.replicas[0].output_device):
            if getattr(self, "_compile_loss", None) is not None:
                # each output's loss tracker (cls_loss, reg_loss): the replicas' trackers saw
                # their shares only, and this model's none (dropped from the logs, 34aj)
                self._compile_loss(y, y_pred, sample_weight)
            return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def _divisor(self) -> float | None:
        """``R`` (a mean over the replicas) for a mean-reduced loss, None (a sum) for a
        ``sum``-reduced one."""
        from keras.src import tree

        losses = (
            [self.loss] if isinstance(self.loss, keras.losses.Loss) else tree.flatten(self.loss)
        )
        reductions = {str(getattr(f, "reduction", "sum_over_batch_size")) for f in losses if f}
        return None if reductions == {"sum"} else float(self.num_replicas)

    def _shard_batch(self, x: Any, y: Any, sample_weight: Any) -> tuple[Any, Any, Any, Any]:
        """``R`` equal shares of the batch, after checking ``R x M`` divides it."""
        n, m = self.num_replicas, self.num_microbatches
        first = tf.convert_to_tensor(_first_leaf(x))
        checks = []
        if first.shape[0] is not None:
            _check_static_batch(int(first.shape[0]), n, m)
        rows = tf.shape(first)[0]
        if first.shape[0] is None:
            checks.append(_batch_assertion(rows // n, rows, n, m))

        xs, ys, sample_weights = (
            split_structure(part, n, checks) for part in (x, y, sample_weight)
        )
        return xs, ys, sample_weights, rows

    def _all_reduce(
        self, gradients: Sequence[Sequence[Any]], divisor: float | None
    ) -> list[tuple[Any, Any]]:
        """``(gradient, variable)`` for every replica's copy of every variable: the combined
        gradient (:func:`~passes.rewrite.pipeline.sum_gradients`), computed once on replica 0's device of the variable, read
        by all."""
        pairs: list[tuple[Any, Any]] = []
        variables = [r.trainable_weights for r in self.replicas]
        for k, first in enumerate(variables[0]):
            grads = [g[k] for g in gradients]
            if any(g is None for g in grads):
                continue
            with tf.device(_device_of(first)):
                reduced = sum_gradients(grads, divisor)
            pairs += [(reduced, v[k]) for v in variables]
        return pairs


def _device_of(variable: Any) -> str:
    return str(getattr(variable, "_value", variable).device)


def _concat(outputs: Sequence[Any]) -> Any:
    from keras.src import tree

    flat = [tree.flatten(o) for o in outputs]
    joined = [tf.concat(list(parts), axis=0) for parts in zip(*flat)]
    return tree.pack_sequence_as(outputs[0], joined)


def _place_updates(optimizer: Any) -> None:
    """Run each variable's ``update_step`` under ``tf.device`` of the variable."""
    if optimizer is None or getattr(optimizer, "_partitioner_placed", False):
        return
    update_step = optimizer.update_step

    def placed_update_step(gradient: Any, variable: Any, learning_rate: Any) -> Any:
        with tf.device(_device_of(variable)):
            return update_step(gradient, variable, learning_rate)

    object.__setattr__(optimizer, "update_step", placed_update_step)
    object.__setattr__(optimizer, "_partitioner_placed", True)


DeviceCheck = Callable[[Sequence[str]], tuple[str, ...]]
"""Checks device strings, returning one key per device (equal keys: the same device):
:func:`check_replica_devices` here, the cluster's own check on a cluster."""


def _check_replica_layouts(
    layer_devices_per_replica: Sequence[Mapping[str, str]],
    check_devices: DeviceCheck = check_replica_devices,
) -> None:
    """Every replica must put the same layers together, on its own devices."""
    first = layer_devices_per_replica[0]
    counts = [len(set(p.values())) for p in layer_devices_per_replica]
    if len(set(counts)) > 1:
        raise RewriteError(
            f"the replicas' device lists have different lengths {counts}: every replica needs "
            "as many stage devices as the others"
        )
    owner: dict[str, int] = {}
    for r, plan in enumerate(layer_devices_per_replica):
        if set(plan) != set(first):
            odd = sorted(set(plan) ^ set(first))[:4]
            raise RewriteError(f"replica {r} places other layers than replica 0: {odd}")
        check_devices(list(dict.fromkeys(plan.values())))
        match: dict[str, str] = {}
        for layer, device in plan.items():
            if match.setdefault(first[layer], device) != device:
                raise RewriteError(
                    f"replica {r} splits the layers into other stages than replica 0 (layer "
                    f"{layer!r} is on {device!r}, not with the others of {first[layer]!r}'s "
                    "stage): every replica must be the same pipeline on its own devices"
                )
        for device in set(plan.values()):
            key = check_devices([device])[0]
            if owner.setdefault(key, r) != r:
                raise RewriteError(
                    f"device {device!r} is in replicas {owner[key]} and {r}; each replica "
                    "needs devices of its own"
                )


def _check_family(stages: int, num_microbatches: int, schedule: Schedule) -> None:
    """Replicas of one stage take no micro-batches; replicas of several stages pipeline."""
    if stages == 1 and num_microbatches != 1:
        raise UsageError(
            f"data parallelism over one stage has no micro-batches; got "
            f"num_microbatches={num_microbatches}: use 1"
        )
    if stages > 1 and schedule is Schedule.NONE:
        raise UsageError(
            "replicas of a plain split (schedule none) are not supported; pipeline them "
            "(schedule gpipe or 1f1b, num_microbatches=1 is the plain step)"
        )


def replicate_pipeline(
    model: keras.Model,
    layer_devices_per_replica: Sequence[Mapping[str, str]],
    *,
    num_microbatches: int,
    schedule: Schedule,
    sample_inputs: Sequence[Any],
    check_devices: DeviceCheck = check_replica_devices,
) -> ReplicatedPipeline:
    """``R = len(layer_devices_per_replica)`` pipelined copies of ``model``, trained
    data-parallel: replica ``r`` places layer ``L`` on ``layer_devices_per_replica[r][L]``.

    Every replica must be the same pipeline (the same layers on each stage, as many stages) on
    devices of its own. Each step splits the global batch into ``R`` equal shares (each split
    again into ``num_microbatches`` micro-batches by the pipeline), averages the gradients over
    the replicas and applies that gradient to every copy. With one device per replica (``S =
    1``) each replica is a :class:`PlacedReplica` and ``num_microbatches`` must be 1: data
    parallelism by the same explicit all-reduce. ``check_devices`` checks the device strings
    (default: this process's devices). Compiled with the original's compile config when the
    original is compiled. The original model is never modified.
    """
    plans = [dict(p) for p in layer_devices_per_replica]
    if len(plans) < 2:
        raise UsageError(
            f"a replicated pipeline needs >= 2 replicas, got {len(plans)}; use pipeline_model "
            "for one"
        )
    _check_replica_layouts(plans, check_devices)
    stages = len(set(plans[0].values()))
    _check_family(stages, num_microbatches, schedule)
    replicas: list[PipelinedModel | PlacedReplica] = [
        _placed_replica(model, plan, sample_inputs)
        if stages == 1
        else pipeline_model(
            model,
            plan,
            num_microbatches=num_microbatches,
            schedule=schedule,
            sample_inputs=sample_inputs,
        )
        for plan in plans
    ]
    suffix = "replicated" if stages == 1 else "replicated_pipeline"
    hybrid = ReplicatedPipeline(replicas, name=f"{model.name}_{suffix}")
    build_keeping_state(
        hybrid, sample_batch([np.concatenate([s] * len(plans)) for s in sample_inputs], model)
    )
    keep_output_names(hybrid, model)
    if model.compiled:
        try:
            hybrid.compile_from_config(model.get_compile_config())
        except RewriteError:
            raise
        except Exception as exc:
            logger.warning("could not copy the compile settings (%s); call compile()", exc)
    return hybrid


# -- every family -----------------------------------------------------------------------------


def realise_strategy(
    model: keras.Model,
    layer_devices_per_replica: Sequence[Mapping[str, str]],
    *,
    num_microbatches: int = 1,
    schedule: Schedule = Schedule.NONE,
    sample_inputs: Sequence[Any],
) -> keras.Model:
    """The copy of ``model`` that trains under a strategy of ``R`` replicas x ``S`` stages.

    ``layer_devices_per_replica[r]`` maps each layer to replica ``r``'s device for it; ``S`` is
    the number of distinct devices per replica. ``schedule`` ``NONE`` (or ``S = 1``) does not
    pipeline. The families: single / plain split (``R = 1``, not pipelined):
    :func:`~passes.rewrite.device_placement.place_model`; pipeline (``R = 1``):
    :func:`~passes.rewrite.pipeline.pipeline_model`; data parallel (``R > 1``, ``S = 1``):
    :func:`replicate_model`; hybrid (``R > 1``, ``S > 1``): :func:`replicate_pipeline`.
    """
    plans = [dict(p) for p in layer_devices_per_replica]
    if not plans:
        raise UsageError("a strategy needs >= 1 replica; got an empty list of placements")
    stages = len(set(plans[0].values()))
    pipelined = schedule is not Schedule.NONE and stages > 1
    if len(plans) == 1:
        check_replica_devices(list(dict.fromkeys(plans[0].values())))
        if pipelined:
            return pipeline_model(
                model,
                plans[0],
                num_microbatches=num_microbatches,
                schedule=schedule,
                sample_inputs=sample_inputs,
            )
        return place_model(model, plans[0], sample_inputs)
    _check_replica_layouts(plans)
    _check_family(stages, num_microbatches, schedule)
    if stages == 1:
        return replicate_model(model, [next(iter(p.values())) for p in plans], sample_inputs)
    return replicate_pipeline(
        model,
        plans,
        num_microbatches=num_microbatches,
        schedule=schedule,
        sample_inputs=sample_inputs,
    )
