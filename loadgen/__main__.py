"""`python -m splitserve.loadgen ...`: the same as `splitserve bench ...`."""

import sys

from splitserve.loadgen.cli import main

sys.exit(main())
