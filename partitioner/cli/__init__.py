"""The ``partition`` command: argument parsing and flag names (:mod:`.main`), loading a model
file (:mod:`.loader`) and serving a cluster task (:mod:`.worker`). Nothing imports this package."""

from partitioner.cli.main import main

__all__ = ["main"]
