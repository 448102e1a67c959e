"""``python -m mmserver``: the same as the ``mmserver`` command."""

from mmserver.cli import main

raise SystemExit(main())
