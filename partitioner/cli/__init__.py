"""The ``partition`` command: argument parsing and flag names (:mod:`.main`), loading a model
file (:mod:`.loader`) and serving a cluster task (:mod:`.worker`). Nothing imports this package.

The console script's first import is this package: Ctrl-C is handled (:mod:`.early`) before
the CLI's own imports, which take a while."""

from partitioner.cli.early import INTERRUPTED_EARLY, interrupt_exits, is_console_script

if is_console_script():
    interrupt_exits(INTERRUPTED_EARLY)

from partitioner.cli.main import main

__all__ = ["main"]
