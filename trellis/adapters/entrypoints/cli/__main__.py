"""`python -m trellis.adapters.entrypoints.cli`: the `trellis` command."""

from trellis.adapters.entrypoints.cli import main

raise SystemExit(main())
