"""`python -m zerokit ...` is the same as the `zerokit` console script."""
import sys

from zerokit.cli import main

sys.exit(main())
