"""Load a Keras model from a Python file named on the command line: ``PATH[:ATTR]``.

The file is imported as a module under a private name, so its ``if __name__ == "__main__":``
block does not run (but everything else in it does, as any import would). ``ATTR`` names a
``keras.Model`` or a zero-argument function returning one; without it the loader looks for
``build_model``, ``create_model``, ``get_model``, ``make_model`` and then for a single module-level
model.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.machinery
import importlib.util
import inspect
import keyword
import logging
import os
import stat
import sys
import tempfile
import threading
import traceback
from collections.abc import Collection, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, cast

from partitioner.core.errors import ModelLoadError, PartitionError, error_line, keras_call, quoting
from partitioner.core.files import (
    BUILDER_NAMES,
    MODEL_MODULE_FLAG,
    check_links_followed,
    file_kind,
    system_dirs,
)
from partitioner.core.units import format_bytes

__all__ = [
    "BUILDER_NAMES",
    "check_model_path",
    "chosen_attr",
    "load_model",
    "loaded_attr",
    "recording_files_read",
    "split_spec",
    "user_files_read",
    "user_module_files",
]

logger = logging.getLogger(__name__)



def split_spec(spec: str) -> tuple[Path, str | None]:
    """``"models/net.py:build"`` -> (Path("models/net.py"), "build")."""
    path, sep, attr = spec.rpartition(":")
    if sep and path.endswith(".py") and attr and "/" not in attr and "\\" not in attr:
        return Path(path), attr
    return Path(spec), None


def check_model_path(spec: str) -> Path:
    """The file of ``PATH[:ATTR]``, checked without importing anything (fails fast)."""
    path, _ = split_spec(spec)
    _check_path(path)
    return path


MAX_MODEL_FILE_BYTES = 16 << 20
"""The largest model file read (16 MiB: a model's source is kilobytes; Python compiles a file
in memory many times its size, and a 600 MB one took 1.9 GB)."""


def _check_path(path: Path) -> None:
    """A ``.py`` regular file (a FIFO or device is refused before anything opens it)."""
    if path.suffix != ".py":
        raise ModelLoadError(
            f"{path} is not a .py file; give a Python file that builds a Keras model"
        )
    try:  # another user's link in a shared directory: not the user's code to run
        check_links_followed(path, "cannot load the model file", streams=False)
    except PartitionError as exc:
        raise ModelLoadError(str(exc)) from None
    if not path.exists():
        raise ModelLoadError(f"no such file: {path}")
    if not path.is_file():
        raise ModelLoadError(
            f"{path} is not a file (it is {file_kind(path.stat().st_mode)}); give a Python "
            "file that builds a Keras model"
        )
    size = path.stat().st_size
    if size > MAX_MODEL_FILE_BYTES:
        raise ModelLoadError(
            f"{path} is {format_bytes(size)}, more than {format_bytes(MAX_MODEL_FILE_BYTES)}, "
            "the largest model file partition reads; is it the right file?"
        )
    try:  # a file of /proc says st_size 0 and may refuse to be read, block, or never end
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as f:
            data = f.read(MAX_MODEL_FILE_BYTES + 1)
    except OSError as exc:
        raise ModelLoadError(
            f"cannot read {path} ({exc.strerror or exc}); give a Python file that builds a "
            "Keras model"
        ) from None
    if data is None:  # nothing ready to read: reading it would block (/proc/kmsg)
        raise ModelLoadError(
            f"cannot read {path} (a read would block: it is no file's source); give a Python "
            "file that builds a Keras model"
        )
    size = len(data)
    if size > MAX_MODEL_FILE_BYTES:
        raise ModelLoadError(
            f"{path} holds more than {format_bytes(MAX_MODEL_FILE_BYTES)}, the largest model "
            "file partition reads; is it the right file?"
        )


def user_module_files(before: Collection[str]) -> list[Path]:
    """The files (absolute) of the modules imported since ``sys.modules`` held the names
    ``before`` from the user's own tree: the model file and the modules it imported, directly
    or not; not the standard library, installed distributions (site-packages) or this
    project's own packages."""
    system = system_dirs()
    files: set[Path] = set()
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if name in before or not isinstance(file, str) or not file:
            continue
        real = Path(os.path.realpath(file))
        if not any(real.is_relative_to(d) for d in system):
            files.add(Path(os.path.abspath(file)))
    return sorted(files)


class _FilesRead:
    """Where :func:`recording_files_read` collects the files opened for reading, by any thread
    of the process (a model may read its files in a thread pool) and by any process forked from
    it meanwhile (a ``multiprocessing`` pool that loads data): a child's own copy of ``files``
    is lost when it exits, so it appends what it reads to ``channel``, an unnamed file the
    recording process reads back at the end. ``files`` None: not recording."""

    def __init__(self) -> None:
        self.files: set[str] | None = None
        self.lock = threading.Lock()
        self.pid = 0
        """The recording process."""
        self.channel: int | None = None
        """A descriptor of the unnamed file forked children append their reads to."""


_FILES_READ = _FilesRead()


def _record_open(event: str, args: tuple[Any, ...]) -> None:
    """The audit hook: an ``open`` for reading while recording adds the file's resolved path,
    resolved now (a symbolic link the code re-points later does not move it). The name may be
    a path object (``io.FileIO(pathlib.Path(...))`` passes it as it is)."""
    if event != "open" or _FILES_READ.files is None:
        return
    if not args or not isinstance(args[0], (str, bytes, os.PathLike)):
        return
    mode = args[1] if len(args) > 1 else None
    if mode is None or "r" in mode or "+" in mode:
        found = _resolved_reads(os.fsdecode(os.fspath(args[0])))
        found += _identities(found)
        if os.getpid() != _FILES_READ.pid and _FILES_READ.channel is not None:
            with contextlib.suppress(OSError):  # a forked child: tell the recording process
                os.write(_FILES_READ.channel, "".join(f"{f}\0" for f in found).encode())
            return
        with _FILES_READ.lock:
            if _FILES_READ.files is not None:
                _FILES_READ.files.update(found)


def _resolved_reads(name: str) -> list[str]:
    """The files an open of ``name`` may have read, resolved through every symbolic link: an
    absolute name is one file; a relative one is relative to the working directory, or to a
    directory descriptor (``os.open(name, flags, dir_fd=fd)``, an ``opener``), which the audit
    event does not carry: every directory the process holds open counts (failing closed)."""
    if os.path.isabs(name):
        return [os.path.realpath(name)]
    found = [os.path.realpath(name)]
    for directory in _open_directories():
        candidate = os.path.realpath(os.path.join(directory, name))
        if os.path.isfile(candidate):
            found.append(candidate)
    return found


IDENTITY_PREFIX = "inode:"
"""A recorded read's file identity, ``inode:DEV:INO:PATH`` (a path recorded is absolute): the
file stays protected under another name (renamed, or read through a link since removed)."""


def _identities(paths: list[str]) -> list[str]:
    """``inode:DEV:INO:PATH`` of each regular file of ``paths`` as it is now."""
    out = []
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            out.append(f"{IDENTITY_PREFIX}{st.st_dev}:{st.st_ino}:{path}")
    return out


def _open_directories() -> list[str]:
    """The directories the process holds a descriptor on (Linux's ``/proc/self/fd``; elsewhere
    none)."""
    try:
        descriptors = os.listdir("/proc/self/fd")
    except OSError:
        return []
    directories = []
    for fd in descriptors:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/") and os.path.isdir(target):
            directories.append(target)
    return directories


@functools.cache
def _install_audit_hook() -> None:
    """Once per process (an audit hook cannot be removed): it records only inside
    :func:`recording_files_read`."""
    sys.addaudithook(_record_open)


@contextlib.contextmanager
def recording_files_read(into: set[str]) -> Iterator[None]:
    """Every file the process opens for reading while inside (any thread, and any process
    forked from it), added to ``into``: the model's code may load a module without importing
    it (``spec_from_file_location`` and ``exec_module``, ``runpy.run_path``) or read data
    files, and an output must not replace any of them (:func:`user_files_read`). Not seen: what
    a new interpreter reads (a ``spawn`` pool, a subprocess such as ``cat``)."""
    from partitioner.cli.quiet import descriptors_closed, kept_copy

    _install_audit_hook()
    with tempfile.TemporaryFile() as made:  # kept high: the model's code may close the low ones
        channel = os.fdopen(kept_copy(made.fileno()), "w+b")
    with _FILES_READ.lock:
        previous = (_FILES_READ.files, _FILES_READ.pid, _FILES_READ.channel)
        _FILES_READ.files, _FILES_READ.pid = into, os.getpid()
        _FILES_READ.channel = channel.fileno()
    try:
        yield
    finally:
        with _FILES_READ.lock:
            _FILES_READ.files, _FILES_READ.pid, _FILES_READ.channel = previous
        try:
            with channel:
                channel.seek(0)
                into.update(f for f in os.fsdecode(channel.read()).split("\0") if f)
        except OSError as exc:  # the model's code closed it: what it read is unknown
            raise descriptors_closed(exc) from None


def exit_call(exc: SystemExit) -> str:
    """``sys.exit(0)``, or ``os._exit(0)`` for one the run turned into an exception
    (:class:`~partitioner.cli.exits.HardExit`), as the model's code called it."""
    from partitioner.cli.exits import HardExit

    call = "os._exit" if isinstance(exc, HardExit) else "sys.exit"
    return f"{call}({exc.code!r})"


def user_files_read(read: Collection[str]) -> list[Path]:
    """The regular files of ``read`` in the user's tree (not the standard library, installed
    distributions or this project's packages), sorted."""
    system = system_dirs()
    return sorted(
        Path(f)
        for f in set(read)
        if not f.startswith(IDENTITY_PREFIX)
        and os.path.isfile(f)
        and not any(Path(os.path.realpath(f)).is_relative_to(d) for d in system)
    )


def user_read_identities(read: Collection[str]) -> dict[tuple[int, int], Path]:
    """``(st_dev, st_ino)`` -> the path it was read under, of the files of ``read`` in the
    user's tree, as they were when read (:data:`IDENTITY_PREFIX`)."""
    system = system_dirs()
    out: dict[tuple[int, int], Path] = {}
    for entry in read:
        if entry.startswith(IDENTITY_PREFIX):
            dev, ino, path = entry.removeprefix(IDENTITY_PREFIX).split(":", 2)
            if not any(Path(path).is_relative_to(d) for d in system):
                out[(int(dev), int(ino))] = Path(path)
    return out


def is_user_file(filename: str, system: Collection[Path] | None = None) -> bool:
    """Whether ``filename`` (a code object's or a warning's) is a file of the user's tree: not
    in ``system`` (default :func:`system_dirs`: the standard library, installed distributions,
    this project's packages), nor a pseudo-file such as ``<frozen ...>``."""
    if not filename or filename.startswith("<"):
        return False
    real = Path(os.path.realpath(filename))
    return not any(real.is_relative_to(d) for d in (system_dirs() if system is None else system))



def _import_file(path: Path) -> ModuleType:
    _check_path(path)
    module_name = _module_name(path)
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ModelLoadError(f"cannot import {path}: not a Python source file")
    module = importlib.util.module_from_spec(spec)
    setattr(module, MODEL_MODULE_FLAG, True)
    # registered as imports are, so what looks its module up (dataclasses, pickle) finds it
    sys.modules[module_name] = module
    _run_module(spec.loader, module, path)
    return module


def _module_name(path: Path) -> str:
    """The name the model file is imported as: its stem, as ``import`` from its directory names
    it, so a process its code spawns (``multiprocessing``'s ``spawn``, whose children import a
    function's module by name to unpickle it) finds it; a private name where the stem would not
    import this file back (not an identifier, already taken, or a module found elsewhere, which
    the model's module would then shadow for the whole run)."""
    stem = path.stem
    private = f"_partitioner_model_{abs(hash(str(path.resolve())))}"
    if not (stem.isidentifier() and stem.isascii()) or keyword.iskeyword(stem):
        return private
    if stem in sys.modules or stem in sys.stdlib_module_names:
        return private
    directory = str(path.resolve().parent)
    elsewhere = [p for p in sys.path if os.path.realpath(p or ".") != directory]
    try:
        found = importlib.machinery.PathFinder.find_spec(stem, [directory])
        shadowed = importlib.machinery.PathFinder.find_spec(stem, elsewhere)
    except (ImportError, ValueError):
        return private
    if found is None or found.origin is None or shadowed is not None:
        return private
    return stem if Path(found.origin).resolve() == path.resolve() else private


@contextlib.contextmanager
def _model_directory_on_path(path: Path) -> Iterator[None]:
    """The model file's directory first on ``sys.path`` while its code runs (the import and the
    builder, which may import a sibling module itself), as ``python model.py`` has it; taken
    off again after, so a user's file named like a module (``types.py``) shadows nothing of the
    run's own. ``sys.argv`` is ``[model file]`` meanwhile, as ``python model.py`` gives it: a
    file parsing its arguments at import read ``partition``'s own (campaign 34ae)."""
    directory = str(path.resolve().parent)
    sys.path.insert(0, directory)
    argv, sys.argv = sys.argv, [str(path)]
    try:
        yield
    finally:
        sys.argv = argv
        if directory in sys.path:
            sys.path.remove(directory)


def _run_module(loader: Any, module: ModuleType, path: Path) -> None:
    """Execute ``module``'s file; whatever it raises (Ctrl-C aside) as one ModelLoadError,
    with the module unregistered again."""
    try:
        loader.exec_module(module)
    except KeyboardInterrupt:
        sys.modules.pop(module.__name__, None)
        raise
    except BaseException as exc:
        sys.modules.pop(module.__name__, None)
        raise _import_error(exc, path) from None


def _import_error(exc: BaseException, path: Path) -> ModelLoadError:
    if isinstance(exc, SyntaxError):
        line = exc.lineno or _nul_line(path)  # Python gives no line for a NUL byte
        return ModelLoadError(
            f"{path}{f':{line}' if line else ''}: syntax error: {exc.msg}; fix the file and "
            "run again"
        )
    if isinstance(exc, SystemExit):
        return ModelLoadError(
            f"importing {path} called {exit_call(exc)}; remove the exit from the model "
            "file (or put it under if __name__ == '__main__':)"
        )
    hidden = _hidden_package(exc, path)
    if hidden is not None:
        return ModelLoadError(
            f"importing {path} failed: its own package {hidden!r} ({path.parent / hidden}) is "
            f"hidden by partitioner's package of that name, which this process imported first; "
            "rename the model's package (or plan it through the library, "
            "partitioner.partition(model, ...), from a program that imports it first)"
        )
    return quoting(
        ModelLoadError(f"importing {path} failed: {_brief(exc, path)}"), error_line(exc, "")
    )


def _hidden_package(exc: BaseException, path: Path) -> str | None:
    """The name of one of partitioner's own top-level packages (``passes``, ``cost_models``)
    that the model's directory holds a package or module of too, when importing the model
    failed on an import: the model's ``from passes import block`` found partitioner's package,
    already in ``sys.modules``, and the error pointed into it (campaign 34x)."""
    from partitioner.core.files import OWN_PACKAGES

    if not isinstance(exc, ImportError):
        return None
    for name in OWN_PACKAGES:
        mine = (path.parent / name).is_dir() or (path.parent / f"{name}.py").is_file()
        quoted = str(exc).split("'")[1::2]  # 'passes', 'passes.mylayers' (campaign 34aa)
        if mine and name in {q.split(".")[0] for q in quoted}:
            return name
    return None


def _nul_line(path: Path) -> int | None:
    """The line of the first NUL byte in ``path`` (Python's syntax error for one has none), or
    None."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    at = data.find(b"\0")
    return data.count(b"\n", 0, at) + 1 if at >= 0 else None


def _brief(exc: BaseException, path: Path) -> str:
    """``Type: message (file:line)`` with the innermost frame in the user's file."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if Path(f.filename) == path]
    where = f" (line {frames[-1].lineno})" if frames else ""
    call = keras_call(exc)
    called = f" in {call}" if call else ""
    return f"{type(exc).__name__}{called}: {error_line(exc, '')}{where}"


def _call_builder(builder: Any, what: str, path: Path) -> Any:
    """``builder()``; whatever it raises (``sys.exit`` and other ``BaseException``s too,
    Ctrl-C aside) as one-line ModelLoadError."""
    try:
        return builder()
    except SystemExit as exc:
        raise ModelLoadError(
            f"{path}:{what}() called {exit_call(exc)} instead of returning a model; "
            "remove the exit from the model file"
        ) from None
    except KeyboardInterrupt:
        raise
    except BaseException as exc:
        raise quoting(
            ModelLoadError(f"{path}:{what}() failed: {_brief(exc, path)}"), error_line(exc, "")
        ) from None


def _as_model(value: Any, what: str, path: Path) -> Any:
    import keras

    if isinstance(value, keras.Model):
        return value
    if callable(value) and not isinstance(value, type):
        try:
            required = [
                p
                for p in inspect.signature(value).parameters.values()
                if p.default is inspect.Parameter.empty
                and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
            ]
        except (TypeError, ValueError):
            required = []
        if required:
            raise ModelLoadError(
                f"{path}:{what} needs arguments ({', '.join(p.name for p in required)}); "
                "name a zero-argument function or a model"
            )
        built = _call_builder(value, what, path)
        if isinstance(built, keras.Model):
            return built
        if inspect.iscoroutine(built):  # an async def: its body never ran
            built.close()  # no "coroutine ... was never awaited" RuntimeWarning
            raise ModelLoadError(
                f"{path}:{what}() returned a coroutine, not a keras.Model (it is an async def); "
                f"make {what} a plain def that returns the model"
            )
        raise ModelLoadError(
            f"{path}:{what}() returned a {type(built).__name__}, not a keras.Model"
        )
    raise ModelLoadError(
        f"{path}:{what} is of type {type(value).__name__}, not a keras.Model or a function "
        "returning one"
    )


def load_model(spec: str, *, weightless: bool = False) -> Any:
    """The model named by ``PATH[:ATTR]`` (see the module docstring).

    ``weightless``: import and build it without allocating its weights
    (:func:`passes.weightless.without_weights`); a model that cannot be built so (a layer
    assigns to a variable while it is built) is built again with its weights when they fit in
    the memory this machine has free (a warning names the layer), and refused in one line with
    the bytes it needs when they do not.
    """
    from passes.backend import check_keras_backend

    check_keras_backend()  # before the model's own `import keras` fails on another backend
    if not weightless:
        return _load(spec)
    from passes.trace import build_sublayers
    from passes.weightless import (
        WeightlessBuildError,
        available_memory_bytes,
        build_without_weights,
    )

    names = _KerasGlobals()
    try:  # layers a subclassed model's build() left unbuilt are built here, without weights too
        return build_without_weights(lambda: build_sublayers(_load(spec)), what=spec)
    except WeightlessBuildError as exc:
        failure = exc
    names.restore()  # the second build as the first would be: its names, its seed generator
    if _fails_with_weights_too(failure.__cause__):  # the model's code is not run a second time
        raise cast(ModelLoadError, failure.__cause__) from None
    free = available_memory_bytes()
    if free is not None and failure.weight_bytes > free:
        raise ModelLoadError(
            f"{failure.reason}, and building it with its weights needs at least "
            f"{format_bytes(failure.weight_bytes)} for them; this machine has "
            f"{format_bytes(free)} free"
        ) from None
    model = _load(spec)  # the user's own error, when the model fails with weights too
    logger.warning("%s; built it with its weights instead", failure.reason)
    return model


class _KerasGlobals:
    """Keras's global state a failed build without weights leaves behind, as it was before:
    the counters of automatic names (``dense``, ``dense_1``, ...; the second build got
    ``sequential_1``, ``dense_2``, and its plan named layers the user's own build never has) and
    the global seed generator (made inside the failed build, its state has no value: an
    unseeded ``keras.random.normal`` then failed the build with weights too), campaign 34w."""

    def __init__(self) -> None:
        from keras.src.backend.common import global_state

        self._state = global_state
        counters = global_state.get_global_attribute("object_name_uids")
        self._counters = None if counters is None else dict(counters)
        self._seed = global_state.get_global_attribute("global_seed_generator")

    def restore(self) -> None:
        import collections

        restored: collections.defaultdict[str, int] = collections.defaultdict(int)
        restored.update(self._counters or {})
        self._state.set_global_attribute("object_name_uids", restored)
        self._state.set_global_attribute("global_seed_generator", self._seed)


SCOPED_PACKAGES = ("keras", "tensorflow", "tf_keras")
"""The packages a weightless build changes: a failure raised where none of their code ran is
not the build's, and building with weights would only repeat it."""


def _fails_with_weights_too(exc: BaseException | None) -> bool:
    """Whether ``exc``, what loading a model without its weights raised, is the loader's error
    about the model's own code (a ``build_model()`` that raises, an import that fails, a builder
    returning no model) with no frame of Keras or TensorFlow on its way: then building it with
    its weights would run the model's code again only to fail the same way."""
    if not isinstance(exc, ModelLoadError):
        return False
    seen: set[int] = set()
    error = exc.__cause__ or exc.__context__  # the model's own exception (None: the loader's)
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        for frame, _ in traceback.walk_tb(error.__traceback__):
            module = str(frame.f_globals.get("__name__", ""))
            if module.split(".")[0] in SCOPED_PACKAGES:
                return False
        error = error.__cause__ or error.__context__
    return True


def _load(spec: str) -> Any:
    path, attr = split_spec(spec)
    with _model_directory_on_path(path):
        return _build(_import_file(path), path, attr)


def _build(module: ModuleType, path: Path, attr: str | None) -> Any:
    """The model ``module`` (imported from ``path``) defines: ``attr``, a builder, or its one
    model (:func:`chosen_attr`)."""
    name = chosen_attr(module, path, attr)
    return _as_model(getattr(module, name), name, path)


def loaded_attr(spec: str) -> str | None:
    """The name in the model file of ``spec`` (``PATH[:ATTR]``, loaded by :func:`load_model`
    in this process) that the model was made from (:func:`chosen_attr`): what an emitted
    program calls to make the same model; None when the file is not loaded here."""
    path, attr = split_spec(spec)
    for module in list(sys.modules.values()):
        if getattr(module, MODEL_MODULE_FLAG, False) and _same_path(module, path):
            try:
                return chosen_attr(module, path, attr)
            except ModelLoadError:
                return None
    return None


def _same_path(module: ModuleType, path: Path) -> bool:
    file = getattr(module, "__file__", None)
    return file is not None and os.path.realpath(file) == os.path.realpath(path)


def chosen_attr(module: ModuleType, path: Path, attr: str | None) -> str:
    """The name of what ``module`` (imported from ``path``) makes its model from: ``attr``, the
    first callable of :data:`BUILDER_NAMES`, or its one public module-level model."""
    import keras

    if attr is not None:
        if not hasattr(module, attr):
            raise ModelLoadError(f"{path} has no attribute {attr!r}")
        return attr
    for name in BUILDER_NAMES:
        if callable(getattr(module, name, None)):
            logger.debug("using %s() from %s", name, path)
            return name
    models = [
        k for k, v in vars(module).items() if isinstance(v, keras.Model) and not k.startswith("_")
    ]
    if len(models) == 1:
        return models[0]
    if len(models) > 1:
        raise ModelLoadError(
            f"{path} defines several models ({', '.join(sorted(models))}); pick one with "
            f"{path}:NAME"
        )
    raise ModelLoadError(
        f"no model found in {path}: define build_model() returning a keras.Model, or name one "
        f"with {path}:NAME"
    )
