"""`python -m service` is the same as the `sweeper` command."""

from service.cli import main

raise SystemExit(main())
