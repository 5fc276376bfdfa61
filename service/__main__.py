"""`python -m service` is the same as the `sweeper` command."""

from service.commands.cli import main

raise SystemExit(main())
