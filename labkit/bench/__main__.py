"""python -m labkit.bench NN: run one stage's benchmark (see labkit/bench/__init__.py)."""

import sys

from labkit.bench import main

sys.exit(main())
