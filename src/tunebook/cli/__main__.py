"""`python -m tunebook.cli ...` is the `tunebook` command."""

import sys

from .main import main

sys.exit(main())
