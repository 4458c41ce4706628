"""`python -m kvcellar.cli`: the `kvcellar` command."""

import sys

from kvcellar.cli import main

sys.exit(main())
