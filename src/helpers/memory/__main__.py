"""``python -m helpers.memory``: the command of helpers.memory.command."""

from helpers.memory.command import main

raise SystemExit(main())
