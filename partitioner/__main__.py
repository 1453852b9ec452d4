"""``python -m partitioner`` runs the CLI."""

from partitioner.cli.main import main

raise SystemExit(main())
