"""`python -m strata` runs the command line."""

import sys

from strata.cli.main import main

sys.exit(main())
