"""Files: every file the library writes goes through :func:`write_atomic` (whole, or the old one
untouched), and several files of one run through :func:`write_all_atomic` (all of them, or none).

What a write may replace: a regular file or nothing. A directory, a named pipe (FIFO), a socket
or a device node (``/dev/null`` too) is refused in one line (:func:`check_output_path`), never
renamed over. A symbolic link is followed: its target is replaced and the link stays a link;
except with ``follow_symlinks=False``, for a path the user did not name (a cache entry) or one
resolved before the user's code ran: then the link itself is replaced, never its target.

What a read accepts (:func:`read_regular_text`, and :func:`read_input_text` with a caller's
error): a regular file (a FIFO, a device such as ``/dev/zero`` or a directory is refused before
it is read, and opened, if at all, without blocking, so nothing hangs) of at most ``max_bytes``,
in UTF-8; with ``follow_symlinks=False`` a symbolic link is refused too (``O_NOFOLLOW``). Every
file the product reads goes through it.
"""

from __future__ import annotations

import codecs
import contextlib
import errno
import hashlib
import importlib.machinery
import importlib.util
import json
import os
import re
import secrets
import shutil
import signal
import site
import stat
import sys
import sysconfig
import tempfile
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

from partitioner.core.errors import OutputError, PartitionError, UsageError
from partitioner.core.jsonfiles import json_digest

__all__ = [
    "BUILDER_NAMES",
    "CACHE_ENTRY_FOLDERS",
    "MAX_LINKS_FOLLOWED",
    "MODEL_MODULE_FLAG",
    "OWN_MARK",
    "OWN_PACKAGES",
    "UnreadableInput",
    "check_links_followed",
    "check_not_hiding_a_module",
    "check_output_path",
    "check_outside_kept_files",
    "check_own_entry",
    "check_replaceable",
    "default_cache_dir",
    "default_caches",
    "directory_name",
    "file_kind",
    "keras_config_file",
    "marked",
    "module_file_of",
    "open_regular",
    "path_argument",
    "read_input_text",
    "read_regular_text",
    "same_file",
    "system_dirs",
    "write_all_atomic",
    "write_atomic",
    "written_by_partitioner",
]


def _umask() -> int:
    """The process's umask (read from /proc where possible, so it is never changed)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def file_kind(mode: int) -> str:
    """What a file of ``st_mode`` ``mode`` is, in words (``a named pipe (FIFO)``)."""
    for test, name in (
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a named pipe (FIFO)"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISLNK, "a symbolic link"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def check_output_path(
    path: str | os.PathLike[str], what: str = "cannot write", *, follow_symlinks: bool = True
) -> Path:
    """The file a write to ``path`` replaces: ``path`` itself, or a symbolic link's final target
    (with ``follow_symlinks=False``, the link itself: it is replaced, its target never written).

    Raises :class:`OutputError` (``"<what> <path>: it is a named pipe (FIFO), ..."``) unless
    that is a regular file (or a link, not followed), or does not exist yet in an existing
    directory."""
    named = directory_name(path)
    if named is not None:
        raise OutputError(f"{what} {path}: it {named}; give a file path")
    if follow_symlinks:
        check_links_followed(path, what)
    target = Path(os.path.realpath(path) if follow_symlinks else os.path.abspath(path))
    try:  # the path itself, followed: /dev/stdout is a pipe, though its resolved name is none
        mode = os.stat(path if follow_symlinks else target, follow_symlinks=follow_symlinks).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as exc:
        raise OutputError(f"{what} {path}: {exc.strerror or exc}; choose another path") from None
    if mode is not None and stat.S_ISDIR(mode):
        raise OutputError(f"{what} {path}: it is a directory; give a file path")
    if mode is not None and not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
        raise OutputError(
            f"{what} {path}: it is {file_kind(mode)}, not a regular file; only a regular file "
            "is ever replaced: give a file path"
        )
    if not target.parent.is_dir():
        raise OutputError(f"{what} {path}: directory {target.parent} does not exist")
    if mode is not None and stat.S_ISREG(mode):
        _check_file_owner(target, f"{what} {path}")
    return target


def check_own_entry(path: Path) -> None:
    """A cache entry (the trace cache's, the profile cache's) is read only through no other
    user's link (:func:`check_links_followed`: a ``traces`` or ``layers`` directory planted in a
    shared cache directory) and only if this user (or root) wrote it: another user's entry in
    a cache anyone may write is not this run's measurement. OutputError otherwise."""
    check_links_followed(path.parent, "the cache directory")
    st = os.lstat(path)
    if st.st_uid not in (os.geteuid(), 0):
        raise OutputError(f"it belongs to another user (uid {st.st_uid})")
    if stat.S_ISREG(st.st_mode) and st.st_mode & 0o022:  # a loose umask: others may edit it
        raise OutputError(f"other users may write it (mode {st.st_mode & 0o777:04o})")


def default_cache_dir() -> Path:
    """``$PARTITIONER_CACHE_DIR``, else ``$XDG_CACHE_HOME/partitioner``, else
    ``~/.cache/partitioner``. ``RuntimeError`` (as :meth:`Path.home` raises without one) when
    the last is meant and the home directory does not exist: a service account's home is often
    missing on purpose (Debian's ``/nonexistent``), and a run made it, with every parent, to
    hold its cache (campaign 34u); callers then run without a cache."""
    explicit = os.environ.get("PARTITIONER_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "partitioner"
    home = Path.home()
    if os.environ.get("HOME") == "" or not home.is_dir():  # HOME='' is no home (not /)
        raise RuntimeError(f"the home directory {home} does not exist")
    return home / ".cache" / "partitioner"


CACHE_ENTRY_FOLDERS = (("traces", "the trace cache"), ("layers", "the profile cache"))
"""A cache directory's folders of entries (``passes.trace_cache``,
``cost_models.measure.profiled``) and what each holds: files a run replaces and removes."""


_CACHE_ENTRY_NAME = re.compile(r"\.?[0-9a-f]{64}\.json(\..*\.tmp)?")
"""The names of the caches' entries (a SHA-256 key) and of their writers' temporary files: the
only files a run replaces or removes in a cache's folders, whichever ``cache_dir`` it has
(``passes.trace_cache``, ``cost_models.measure.profiled``)."""


def _check_outside_cache(path: str, shown: str, caches: Sequence[str]) -> None:
    """``path`` (resolved) is none of ``caches`` (cache directories, made yet or not) and not
    a folder of cache entries (:data:`CACHE_ENTRY_FOLDERS`, both of each cache, whether this run
    uses it or not) nor in one. UsageError naming ``shown`` (``"--out plan.json"``) otherwise: a
    plan written there became a cache entry, replaced by the next run, or a file where the
    cache or its folder belongs, every later run's cache failing (campaigns 34p, 34u, 34v). In
    any cache's folders (a ``cache_dir=`` given to ``partition()``), only a name like an entry's
    is refused: eviction removes no other file (campaign 34z)."""
    for cache in caches:
        if os.path.realpath(cache) == path:
            raise UsageError(
                f"{shown} is the cache directory ({cache}), which runs keep their caches in; "
                "give a path outside it"
            )
        for folder, what in CACHE_ENTRY_FOLDERS:
            directory = os.path.join(cache, folder)
            if os.path.realpath(directory) in (os.path.dirname(path), path):
                raise UsageError(
                    f"{shown} is in {what} ({directory}), whose files a run replaces and "
                    "removes; give a path outside it"
                )
    folder, name = os.path.split(path)
    names = {entries for entries, _ in CACHE_ENTRY_FOLDERS}
    if os.path.basename(folder) in names and _CACHE_ENTRY_NAME.fullmatch(name):
        raise UsageError(
            f"{shown} is named like a cache entry (a key, .json) in a folder named like a "
            f"cache's ({folder}), which a run with that cache replaces or removes; give "
            "another name"
        )


def check_outside_kept_files(
    path: str, shown: str, caches: Sequence[str] | None = None
) -> None:
    """``path`` (resolved) is none of the files every run keeps or reads for itself:
    partitioner's own installation and Keras's configuration (:func:`_check_outside_own_files`),
    a cache directory or a folder of its entries (:func:`_check_outside_cache`; ``caches``,
    default :func:`default_caches`). The one check of ``--out``, ``--report``, ``--emit``,
    ``partition calibrate --out`` and :meth:`~partitioner.plan.model.Plan.save`."""
    _check_outside_own_files(path, shown)
    _check_outside_cache(path, shown, default_caches() if caches is None else caches)


def default_caches() -> list[str]:
    """The default cache directory (:func:`default_cache_dir`) as a list for
    :func:`check_outside_kept_files`; none without a home directory."""
    try:
        return [str(default_cache_dir())]
    except RuntimeError:
        return []


def keras_config_file() -> Path:
    """The ``keras.json`` Keras reads when it is imported (whether it exists or not): in
    ``$KERAS_HOME``, else in ``~/.keras`` (``/tmp/.keras`` where the home directory cannot be
    written, as Keras chooses)."""
    if "KERAS_HOME" in os.environ:
        base = os.environ["KERAS_HOME"]
    else:
        home = os.path.expanduser("~")
        base = os.path.join(home if os.access(home, os.W_OK) else "/tmp", ".keras")
    return Path(os.path.expanduser(base), "keras.json")


def _check_outside_own_files(path: str, shown: str) -> None:
    """``path`` (resolved) is not in this project's own installation (its package data: the
    device catalog every run reads) nor Keras's configuration file (which every run reads when
    it imports Keras): UsageError naming ``shown`` otherwise. The command line's outputs and
    :meth:`~partitioner.plan.model.Plan.save` alike, through :func:`check_outside_kept_files` (a plan saved over the packaged catalog
    broke every later run, campaign 34v)."""
    own = [d for d in system_dirs() if d.name in OWN_PACKAGES]
    if any(Path(path).is_relative_to(d) for d in own):
        raise UsageError(
            f"{shown} is in partitioner's own installation, whose files (the device catalog, "
            "the calibrations) every run reads; give a path outside it"
        )
    if same_file(path, keras_config_file()):
        raise UsageError(
            f"{shown} is Keras's configuration file, which this run reads (Keras did, when it "
            "was imported); refusing to overwrite it: give another path"
        )


def path_argument(value: object, what: str, example: str) -> str:
    """``value`` (a library argument naming a file or directory) as a string path: UsageError
    naming ``what`` and showing ``example`` unless it is a ``str`` or ``os.PathLike`` of one,
    non-empty and without a NUL character (which no path can hold)."""
    text = os.fspath(value) if isinstance(value, str | os.PathLike) else None
    if not isinstance(text, str) or not text:
        shown = type(value).__name__ if not isinstance(value, str) else "an empty string"
        raise UsageError(f"{what} needs a path (a str or os.PathLike), got {shown}; {example}")
    if "\0" in text:
        raise UsageError(
            f"{what}={text[:60]!r} holds a NUL character, which no path can; {example}"
        )
    return text


def directory_name(path: str | os.PathLike[str]) -> str | None:
    """How ``path`` names a directory by its spelling alone (``out/``, ``plan.json/.``,
    ``..``), or None: ``"ends with a slash, which names a directory"``."""
    text = os.fspath(path)
    if text.endswith(("/", os.sep)):
        return "ends with a slash, which names a directory"
    if os.path.basename(text) in (".", ".."):
        return f"ends with {os.path.basename(text)!r}, which names a directory"
    return None


def _check_file_owner(target: Path, head: str) -> None:
    """The existing regular file ``target`` may be replaced: not a file of another user in a
    sticky directory writable by all (``/tmp``), unless the directory's owner made it, as Linux's
    ``fs.protected_regular`` refuses to open one for writing. A rename over it never meets the
    kernel's check, and another user's file planted at ``/tmp/placed.py`` would be replaced by
    ours, which they could then edit (it keeps the replaced file's permissions)."""
    try:
        st, parent = os.lstat(target), os.stat(target.parent)
    except OSError:
        return
    shared = _shared_sticky(parent.st_mode)
    if shared and st.st_uid not in (os.geteuid(), parent.st_uid):
        raise OutputError(
            f"{head}: it is a file of another user (uid {st.st_uid}) in {target.parent}, a "
            f"{shared}; refusing to replace it (as the kernel's protected_regular would): give "
            "a path of your own"
        )


def _shared_sticky(mode: int) -> str | None:
    """How a directory of ``mode`` is shared with other users, in words, when it is sticky and
    others may write to it (anyone, or its group: Linux's ``protected_regular=2`` covers both),
    else None."""
    if not mode & stat.S_ISVTX:
        return None
    if mode & stat.S_IWOTH:
        return "sticky directory anyone may write to"
    if mode & stat.S_IWGRP:
        return "sticky directory its group may write to"
    return None


MAX_LINKS_FOLLOWED = 40
"""As many symbolic links as the kernel follows in one path (``ELOOP`` past it)."""


_FD_DIRECTORY = re.compile(r"^/proc/[^/]+(/task/[^/]+)?/fd$")
"""A process's directory of open file descriptors (``/dev/stdout`` leads into one)."""


def check_links_followed(
    path: str | os.PathLike[str],
    what: str,
    shown: str | os.PathLike[str] | None = None,
    *,
    streams: bool = True,
) -> None:
    """Every symbolic link ``path`` leads through, in any component, link after link, may be
    followed, as Linux's ``fs.protected_symlinks`` has it: not a link of another user in a
    sticky directory writable by all (``/tmp``), unless the directory's owner made it. A write
    that resolves links itself and renames over the target never meets the kernel's check, so
    another user's link planted at ``/tmp/plan.json`` (or ``/tmp/sub`` of ``/tmp/sub/plan.json``)
    would have the run replace any file it may write. Nor may it lead to an open file
    descriptor (``/dev/stdout``, ``/proc/self/fd/1``): a stream appended to a file
    (``>> journal.txt``) would have that file replaced whole (``streams=False``, for an input:
    it may). OutputError naming ``shown`` (default ``path``) otherwise."""
    current, pending = "/", list(reversed(Path(os.path.abspath(path)).parts[1:]))
    followed = 0
    while pending and followed <= MAX_LINKS_FOLLOWED:  # past it, the kernel's ELOOP says
        part = pending.pop()
        if part in ("", "."):
            continue
        if part == "..":
            current = os.path.dirname(current)
            continue
        candidate = os.path.join(current, part)
        if streams and _FD_DIRECTORY.match(current):
            raise OutputError(
                f"{what} {shown or path}: it leads to {candidate}, an open file descriptor "
                "(a stream such as stdout), not a file; give a file path"
            )
        try:
            link = os.lstat(candidate)
            target = os.readlink(candidate) if stat.S_ISLNK(link.st_mode) else None
        except OSError:
            return  # what is not there is not followed; the caller says what it is
        if target is None:
            current = candidate
            continue
        _check_link_owner(candidate, link, current, f"{what} {shown or path}")
        followed += 1
        parts = Path(target).parts
        if target.startswith("/"):
            current, parts = "/", parts[1:]
        pending.extend(reversed(parts))


def _check_link_owner(link_path: str, link: os.stat_result, directory: str, head: str) -> None:
    """The symbolic link ``link_path`` (``link``: its lstat) in ``directory`` may be followed."""
    parent = os.stat(directory)
    shared = _shared_sticky(parent.st_mode)
    if shared and link.st_uid not in (os.geteuid(), parent.st_uid):
        raise OutputError(
            f"{head}: {link_path} is a symbolic link of another user (uid {link.st_uid}) in "
            f"{directory}, a {shared}; refusing to follow it (as the kernel's "
            "protected_symlinks would): give a path of your own"
        )


BUILDER_NAMES = ("build_model", "create_model", "get_model", "make_model")
"""The functions a model file's builder is looked for under, in order, when the command line
names none (``PATH`` rather than ``PATH:ATTR``); emitted programs look them up the same way."""

MODEL_MODULE_FLAG = "__partitioner_model_file__"
"""Set (to ``True``) on the module the CLI imported a model file as. That module is named as
``import`` would name it where it can be (the file's stem), so a process the model's code spawns
imports it again to unpickle its functions; what must not import it by that name (an emitted
module, which loads the model's file itself) tells it by this flag."""

MAX_REPLACEABLE_BYTES = 64 * 2**20
"""The largest existing file an output may replace: a plan, report or module partitioner writes
is far smaller, so a larger file is the user's data."""


def binary_offset(path: str | os.PathLike[str]) -> int | None:
    """Where the regular file ``path`` first holds data that is not UTF-8 text (a NUL byte or an
    invalid sequence; the whole file is read, in chunks), or ``None`` for a text file."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with open(path, "rb") as f:
        while chunk := f.read(2**20):
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as exc:
                return offset + max(exc.start, 0)
            if b"\x00" in chunk:
                return offset + chunk.index(b"\x00")
            offset += len(chunk)
    pending = len(decoder.getstate()[0])
    return offset - pending if pending else None  # the file ends inside a character


OWN_MARK = "written by partitioner, sha256 "
"""The last line of a text file partitioner writes (an emitted program, an HTML report), in a
comment of its language, before the SHA-256 of the text above it (:func:`marked`)."""

_MARK_LINE = re.compile(r"(?:# |<!-- )written by partitioner, sha256 ([0-9a-f]{64})(?: -->)?")


def marked(text: str, comment: Literal["#", "<!--"]) -> str:
    """``text`` ending with its mark (:data:`OWN_MARK`): the proof, for a later run, that the
    file is one partitioner wrote and may replace (:func:`written_by_partitioner`). A JSON file
    proves it by its ``digest`` instead (:func:`~partitioner.core.jsonfiles.json_digest`)."""
    body = text if text.endswith("\n") else text + "\n"
    close = " -->" if comment == "<!--" else ""
    return f"{body}{comment} {OWN_MARK}{hashlib.sha256(body.encode()).hexdigest()}{close}\n"


def written_by_partitioner(path: str | os.PathLike[str]) -> bool:
    """Whether the regular file ``path`` is one partitioner wrote, unchanged since: text whose
    last line is its mark (:func:`marked`), or JSON whose ``digest`` is its data's (a plan, a
    calibrated topology). A user's file is not, whatever its name or words: a guess by content
    (a ``schema_version`` first, the word "partitioner") replaced a config and notes the model
    reads (campaign 34ac)."""
    try:
        text = read_regular_text(path, MAX_REPLACEABLE_BYTES)
    except (UnreadableInput, OSError):
        return False
    head, newline, last = text.rstrip("\n").rpartition("\n")
    found = _MARK_LINE.fullmatch(last)
    if found is not None:
        digest = hashlib.sha256((head + newline).encode()).hexdigest()
        return bool(newline) and digest == found.group(1)
    try:  # a key given twice hides a value from the digest (campaign 34ad): the user's
        data = json.loads(text, object_pairs_hook=_unique_keys)
        return isinstance(data, dict) and data.get("digest") == json_digest(data)
    except (ValueError, RecursionError):  # deep nesting: json_digest recurses too (34af)
        return False


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's keys, ValueError if one is given twice."""
    data = dict(pairs)
    if len(data) != len(pairs):
        raise ValueError("a key given twice")
    return data


def check_replaceable(target: Path, shown: str) -> None:
    """An existing regular file ``target`` is replaced only if it is empty or partitioner wrote
    it (:func:`written_by_partitioner`): anything else is the user's (a data file the model's
    code opens only when it trains, by a path it builds at run time, which no import, ``open``
    or name a run sees; binary data read through native code, an h5py weights file, a sqlite
    database), and nothing the user had is overwritten. Raises :class:`OutputError` naming
    ``shown`` (the option and the path as the user gave them)."""
    try:
        st = os.stat(target)
        if not stat.S_ISREG(st.st_mode) or st.st_size == 0:
            return
        where = None if st.st_size > MAX_REPLACEABLE_BYTES else binary_offset(target)
    except OSError:
        return  # unreadable or gone: the writability check says why
    if st.st_size > MAX_REPLACEABLE_BYTES:
        found = f"is larger ({st.st_size} bytes) than any file partitioner writes"
    elif where is not None:
        found = f"holds binary data (from byte {where}), which partitioner never writes"
    elif not written_by_partitioner(target):
        found = "is not a file partitioner wrote (a plan, report, program or topology file)"
    else:
        return
    raise OutputError(
        f"{shown} exists and {found}; refusing to replace it (it may be your data): remove it "
        "first, or give another path"
    )


def check_not_hiding_a_module(target: str, shown: str) -> None:
    """An output ``target`` Python would import as a module (``.py``, ``.pyc``, an extension
    module's suffix; not ``__init__``, which makes its folder a package) is named like no module
    Python finds elsewhere on its path
    (Keras, NumPy, the standard library's ``colorsys``), no package directory beside it (a
    namespace package ``mylib/`` the model imports from, 34ah) and no module this run imported:
    a program is imported from its own directory first, so the file would be imported in that
    module's place by the model beside it, by the emitted program itself and by every later run
    there (``--emit keras.py`` made them all fail, campaign 34ag). Raises :class:`OutputError`
    naming ``shown``."""
    base = os.path.basename(target)
    suffix = next((s for s in importlib.machinery.all_suffixes() if base.endswith(s)), None)
    name = base[: -len(suffix)] if suffix else ""  # .py, .pyc, an extension module's .so
    if not name.isidentifier():
        return
    folder = os.path.dirname(os.path.realpath(target))
    if name == "__init__":
        raise OutputError(
            f"{shown} is the file that makes {folder} a package ({base}); refusing to write "
            "over it or in its place: give another name"
        )
    elsewhere = [p for p in sys.path if os.path.realpath(p or os.curdir) != folder]
    imported = sys.modules.get(name)
    sibling = _module_beside(folder, name, base)
    if name in sys.builtin_module_names:
        where = "built into Python"
    elif os.path.isdir(os.path.join(folder, name)):  # a package there, a namespace one too
        where = f"from the directory {os.path.join(folder, name)} beside it"
    elif sibling is not None:  # helpers.py beside --out helpers.so: which one is imported
        where = f"from {sibling} beside it"
    elif imported is not None and getattr(imported, "__file__", None) != os.path.realpath(target):
        where = "in this run (the model's code imported it)"
    else:
        spec = importlib.machinery.PathFinder.find_spec(name, elsewhere)
        if spec is None:
            return
        where = f"from {spec.origin or next(iter(spec.submodule_search_locations or ()), '?')}"
    raise OutputError(
        f"{shown} is named like the module {name!r} that Python imports {where}; as {base} "
        "it would be imported in that module's place (by the model beside it, by an emitted "
        f"program itself, by every later run there): give another name, e.g. {name}_plan.py"
    )


def _module_beside(folder: str, name: str, base: str) -> str | None:
    """A module file ``name`` + another import suffix in ``folder`` (``helpers.py`` beside an
    output ``helpers.so``; Python prefers extension modules, then sources, then ``.pyc``:
    either may stand in for the other, campaign 34ak), else None."""
    for suffix in importlib.machinery.all_suffixes():
        candidate = os.path.join(folder, name + suffix)
        if name + suffix != base and os.path.isfile(candidate):
            return candidate
    return None


def same_file(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> bool:
    """Whether ``a`` and ``b`` name one file (through links, hard links, ``..``)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def _new_mode(target: Path) -> int:
    """The permission bits of the regular file ``target`` (never a link's target), else those a
    plain ``open()`` would give."""
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        return 0o666 & ~_umask()
    return st.st_mode & 0o777 if stat.S_ISREG(st.st_mode) else 0o666 & ~_umask()


def _stage(target: Path, text: str, private: bool = False) -> str:
    """A temporary file beside ``target`` holding ``text`` (synced), with the mode a plain
    ``open()`` would give (or the mode of the file it replaces; 0600 when ``private``); its
    path."""
    try:
        prefix = f".{_short_name(target.name)}."
        fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=".tmp", dir=target.parent)
    except OSError as exc:
        raise OutputError(f"cannot write {target}: {exc.strerror or exc}") from None
    try:
        mode = 0o600 if private else _new_mode(target)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            os.fchmod(fh.fileno(), mode)
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise OutputError(f"cannot write {target}: {exc.strerror or exc}") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return tmp


def write_atomic(
    path: str | os.PathLike[str],
    text: str,
    *,
    follow_symlinks: bool = True,
    private: bool = False,
    only_ours: bool = False,
) -> Path:
    """Write ``text`` to ``path`` through a temporary file and a rename (only over a regular
    file; a symbolic link's target is replaced, the link kept: :func:`check_output_path`; with
    ``follow_symlinks=False`` the link itself is replaced and its target left as it was).
    ``private``: mode 0600 whatever the umask (a cache entry no other user may edit);
    ``only_ours``: as :func:`write_all_atomic`."""
    write_all_atomic(
        [(path, text)], follow_symlinks=follow_symlinks, private=private, only_ours=only_ours
    )
    return Path(path)


def _short_name(name: str, limit: int = 200) -> str:
    """``name``, cut to ``limit`` bytes for the name of a file written beside it: a temporary
    file ``.NAME.XXXXXXXX.tmp`` of a legal 250-character name would pass the file system's 255
    (campaign 34s: "File name too long" for a name ``touch`` takes)."""
    raw = os.fsencode(name)
    return name if len(raw) <= limit else raw[:limit].decode("utf-8", "ignore")


def module_file_of(path: str | os.PathLike[str]) -> str | None:
    """The name of the module this process imported from the file ``path`` (the running
    script's ``__main__`` too), or None: a program's own source is never an output."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if not isinstance(file, str):
            continue
        try:
            other = os.stat(file)
        except OSError:
            continue
        if (other.st_dev, other.st_ino) == (st.st_dev, st.st_ino):
            return name
    return None


def _backup(target: Path) -> str | None:
    """A hard link to ``target``'s current file (None when there is none), so a failed
    multi-file write can put it back."""
    if not os.path.lexists(target):
        return None
    backup = str(target.parent / f".{_short_name(target.name)}.{secrets.token_hex(8)}.old")
    try:
        os.link(target, backup, follow_symlinks=False)
    except OSError:
        try:  # a file system without hard links
            shutil.copy2(target, backup, follow_symlinks=False)
        except OSError as exc:
            Path(backup).unlink(missing_ok=True)
            raise OutputError(f"cannot write {target}: {exc.strerror or exc}") from None
    return backup


def _undo(done: Sequence[tuple[Path, str | None, bool]]) -> None:
    """Put back what the renames in ``done`` (``(target, backup, made)``) replaced; remove the
    files they made (``made``); a file replaced without a backup stays whole-new."""
    for target, backup, made in reversed(done):
        try:
            if backup is not None:
                os.replace(backup, target)
            elif made:
                target.unlink(missing_ok=True)
        except OSError:
            pass


def write_all_atomic(
    files: Sequence[tuple[str | os.PathLike[str], str]],
    *,
    follow_symlinks: bool = True,
    private: bool = False,
    only_ours: bool = False,
) -> None:
    """Write each ``(path, text)``: every file whole, or, on any failure, none of them (files
    already replaced get their old content back; new ones are removed). A Ctrl-C, SIGTERM or
    SIGHUP arriving meanwhile is held until the files are as they were (one file already
    replaced alone stays whole-new), then acted on (campaign 34ag: one landing between two
    files left a staged ``.plan.json.*.tmp``). ``follow_symlinks``:
    as :func:`check_output_path`; ``private``: as :func:`write_atomic`; ``only_ours``: each
    target is checked again right before its rename (:func:`check_replaceable`): a user's
    file written there while the outputs were staged (seconds for a large report) is kept
    (campaign 34ak)."""
    follow = follow_symlinks
    targets = [check_output_path(path, follow_symlinks=follow) for path, _ in files]
    staged: list[str] = []
    done: list[tuple[Path, str | None, bool]] = []
    with _interrupts_held() as arrived:
        try:
            for target, (_, text) in zip(targets, files):
                staged.append(_stage(target, text, private))
            for target, tmp in zip(targets, staged):
                check_output_path(target, follow_symlinks=follow)
                if arrived:
                    raise KeyboardInterrupt  # caught below: nothing more is replaced
                if only_ours and not (not follow and os.path.islink(target)):
                    check_replaceable(target, str(target))  # a link itself is replaced
                backup = _backup(target) if len(files) > 1 else None
                made = not os.path.lexists(target)
                try:
                    os.replace(tmp, target)
                except OSError as exc:
                    if backup is not None:
                        Path(backup).unlink(missing_ok=True)
                    raise OutputError(f"cannot write {target}: {exc.strerror or exc}") from None
                done.append((target, backup, made))  # signals are held: nothing between
            if arrived:
                raise KeyboardInterrupt  # caught below: nothing kept; the signal acts on exit
        except BaseException as exc:
            _undo(done)
            for tmp in staged:
                Path(tmp).unlink(missing_ok=True)
            if arrived and isinstance(exc, KeyboardInterrupt):
                return  # the held signal is raised on leaving the block
            raise
        finally:
            for _, backup, _made in done:
                if backup is not None:
                    Path(backup).unlink(missing_ok=True)


_HELD_SIGNALS = tuple(
    getattr(signal, name)
    for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGALRM",
                 "SIGVTALRM", "SIGPROF", "SIGXCPU")
    if hasattr(signal, name)
)  # fmt: skip
"""The signals :func:`write_all_atomic` holds: every one whose default action ends the process
(a batch scheduler's SIGUSR1 or SIGALRM warning, ``ulimit -t``'s SIGXCPU: 34aj) but SIGKILL and
SIGSTOP, which no process can hold, and SIGPIPE and SIGXFSZ, which Python ignores."""


@contextlib.contextmanager
def _interrupts_held() -> Iterator[list[int]]:
    """The signals of :data:`_HELD_SIGNALS` (Ctrl-C, SIGTERM, SIGHUP of a closed terminal,
    34ah) held while the block runs; those whose handler ends the run (the default action,
    Python's ``KeyboardInterrupt``, a handler marked ``ends_run``) are recorded in the list
    yielded, so the block undoes its files. Afterwards every held signal is raised again under
    the handlers that were in place: one ignored (``nohup``'s SIGHUP) or handled by the
    program's own function leaves the files written (they were undone, and the run reported
    them written, campaign 34am). Only in the main thread with Python handlers installed
    (where Python runs its handlers); elsewhere a no-op."""
    arrived: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield arrived
        return
    handlers = {s: signal.getsignal(s) for s in _HELD_SIGNALS}
    if any(h is None for h in handlers.values()):  # installed outside Python: left alone
        yield arrived
        return
    deferred: list[int] = []

    def hold(signum: int, _frame: object) -> None:
        (arrived if _ends_run(handlers[signum]) else deferred).append(signum)

    for s in _HELD_SIGNALS:
        signal.signal(s, hold)
    try:
        yield arrived
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
        for s in dict.fromkeys(deferred):
            signal.raise_signal(s)
        if arrived:
            signal.raise_signal(arrived[0])


def _ends_run(handler: Any) -> bool:
    """Whether a signal ``handler`` ends the run: the default action (every held signal's is to
    end the process), Python's ``KeyboardInterrupt``, or a handler marked ``ends_run``."""
    return (
        handler is signal.SIG_DFL
        or handler is signal.default_int_handler
        or bool(getattr(handler, "ends_run", False))
    )


class UnreadableInput(PartitionError):
    """A file :func:`read_regular_text` does not read, and why: ``reason`` is
    ``it is a named pipe (FIFO), not a regular file``, ``it does not exist``, ..."""

    def __init__(self, path: str | os.PathLike[str], reason: str, *, kind: str) -> None:
        super().__init__(f"cannot read {path}: {reason}")
        self.reason = reason
        self.kind = kind
        """``missing``, ``type`` (not a regular file), ``size``, ``encoding`` or ``os``."""


def open_regular(path: str | os.PathLike[str], follow_symlinks: bool = True) -> int:
    """A descriptor of the regular file ``path``, opened without blocking (``O_NONBLOCK``: a
    FIFO swapped in after the check does not hang the open) and checked again through it;
    without ``follow_symlinks`` a symbolic link is refused (``O_NOFOLLOW``, race-free)."""
    try:
        st = os.stat(path, follow_symlinks=follow_symlinks)
    except FileNotFoundError:
        raise UnreadableInput(path, "it does not exist", kind="missing") from None
    except OSError as exc:
        raise UnreadableInput(path, str(exc.strerror or exc), kind="os") from None
    if not stat.S_ISREG(st.st_mode):
        kind = file_kind(st.st_mode)
        raise UnreadableInput(path, f"it is {kind}, not a regular file", kind="type")
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
    if not follow_symlinks:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP and not follow_symlinks:
            reason = "it is a symbolic link, not a regular file"
            raise UnreadableInput(path, reason, kind="type") from None
        raise UnreadableInput(path, str(exc.strerror or exc), kind="os") from None
    try:
        mode = os.fstat(fd).st_mode
    except OSError as exc:
        os.close(fd)
        raise UnreadableInput(path, str(exc.strerror or exc), kind="os") from None
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = file_kind(mode)
        raise UnreadableInput(path, f"it is {kind}, not a regular file", kind="type")
    return fd


def read_regular_text(
    path: str | os.PathLike[str], max_bytes: int, *, follow_symlinks: bool = True
) -> str:
    """The UTF-8 text of the regular file ``path`` of at most ``max_bytes``, else
    :class:`UnreadableInput` saying why. The one bounded reader of every file the product
    reads: a FIFO, a device (``/dev/zero``), a socket or a directory is refused before it is
    read, never blocked on, and the size limit holds for a file that grows while it is read.
    ``follow_symlinks=False`` refuses a symbolic link too (a cache entry: a link there is not
    the product's file)."""
    fd = open_regular(path, follow_symlinks)
    too_big = UnreadableInput(
        path, f"it is larger than {_size(max_bytes)}, the most read", kind="size"
    )
    try:
        with os.fdopen(fd, "rb") as fh:
            if os.fstat(fh.fileno()).st_size > max_bytes:
                raise too_big
            data = fh.read(max_bytes + 1)
    except OSError as exc:
        raise UnreadableInput(path, str(exc.strerror or exc), kind="os") from None
    if data is None:  # a non-blocking read with nothing ready (/proc/kmsg): it would block
        raise UnreadableInput(path, "it has nothing to read yet (a read would block)", kind="os")
    if len(data) > max_bytes:
        raise too_big
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UnreadableInput(
            path, f"it is not UTF-8 text (byte {exc.start})", kind="encoding"
        ) from None


def _size(max_bytes: int) -> str:
    """``1 MiB`` (or ``512 bytes`` below one MiB)."""
    return f"{max_bytes // 2**20} MiB" if max_bytes >= 2**20 else f"{max_bytes} bytes"


def read_input_text(
    path: str | os.PathLike[str], what: str, error: type[PartitionError], max_bytes: int
) -> str:
    """The UTF-8 text of the regular file ``path`` of at most ``max_bytes``
    (:func:`read_regular_text`); ``error`` naming ``what`` (``plan file``) and the path
    otherwise."""
    try:
        check_links_followed(path, f"cannot read {what}", streams=False)
    except OutputError as exc:  # another user's link in a shared directory: not the user's
        raise error(str(exc)) from None
    try:
        return read_regular_text(path, max_bytes)
    except UnreadableInput as exc:
        reason = exc.reason.removeprefix("it ")
        if exc.kind == "missing":
            raise error(f"no such {what}: {path}; check the path") from None
        if exc.kind == "type":
            kind = reason.removesuffix(", not a regular file")
            raise error(f"{what} {path} {kind}; give a regular file") from None
        if exc.kind in ("size", "encoding"):
            raise error(f"{what} {path} {reason}; is it the right file?") from None
        raise error(
            f"cannot read {what} {path}: {exc.reason}; check it is the right file and readable"
        ) from None


OWN_PACKAGES = ("partitioner", "cost_models", "passes")
"""This project's packages: their modules are never the user's."""


def system_dirs() -> list[Path]:
    """The directories whose modules are not the user's: the standard library, every
    site-packages, this project's packages (resolved)."""
    dirs = {sysconfig.get_path(key) for key in ("stdlib", "platstdlib", "purelib", "platlib")}
    dirs.update(site.getsitepackages())
    if site.ENABLE_USER_SITE:
        dirs.add(site.getusersitepackages())
    for package in OWN_PACKAGES:
        spec = importlib.util.find_spec(package)
        if spec is not None:
            dirs.update(spec.submodule_search_locations or ())
    return [Path(os.path.realpath(d)) for d in dirs if d]
