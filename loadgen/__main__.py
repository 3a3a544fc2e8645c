"""`python -m splitserve.loadgen ...`: the same as `splitserve bench ...`."""

import sys

from .cli import main

sys.exit(main())
