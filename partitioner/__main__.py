"""``python -m partitioner`` runs the CLI."""

from partitioner.cli import main

raise SystemExit(main())
