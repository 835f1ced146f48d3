"""``python -m fzero.cli``: the ``fzero`` command without its console script (what an elastic
job's joining node runs). ``-m fzero.cli.main`` would run a module the package has already
imported, which runpy warns about."""

import sys

from fzero.cli.main import main

sys.exit(main())
