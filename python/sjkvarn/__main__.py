"""``python -m sjkvarn`` runs the command-line interface."""

from sjkvarn.cli import main

raise SystemExit(main())
