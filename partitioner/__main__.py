"""``python -m partitioner`` runs the CLI.

Ctrl-C is one line and status 130 from the first line here on: the CLI's imports take a while
(and its run imports TensorFlow), and a ``KeyboardInterrupt`` among them would print a traceback.
:func:`partitioner.cli.main.main` takes over the handling once imported.
"""

import os
import signal


def _interrupted(signum: int, frame: object) -> None:
    """Nothing is written yet: say so and end at once."""
    try:
        os.write(2, b"partition: interrupted; nothing was written\n")
    finally:
        os._exit(130)


if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:  # ignored stays ignored
    signal.signal(signal.SIGINT, _interrupted)

from partitioner.cli.main import main  # noqa: E402

raise SystemExit(main())
