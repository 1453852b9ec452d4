"""``python -m partitioner`` runs the CLI.

Ctrl-C is one line and status 130 from the first line here on (:mod:`partitioner.cli.early`):
the CLI's imports take a while (and its run imports TensorFlow), and a ``KeyboardInterrupt``
among them would print a traceback. :func:`partitioner.cli.main.main` takes over the handling
once imported.
"""

from partitioner.cli.early import INTERRUPTED_EARLY, interrupt_exits

interrupt_exits(INTERRUPTED_EARLY)

from partitioner.cli.main import main  # noqa: E402

raise SystemExit(main())
