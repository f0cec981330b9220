"""`python -m trellis.adapters.entrypoints.cli`: the `trellis` command."""

from trellis.adapters.entrypoints.cli.main import main

raise SystemExit(main())
