"""`python -m minibert`: the command line (`minibert.cli.main`)."""

import sys

from .cli import main

sys.exit(main())
