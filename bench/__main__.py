"""`python -m bench` is `specedge-bench`."""

import sys

from .cli import main

sys.exit(main())
