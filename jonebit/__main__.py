"""``python -m jonebit COMMAND``: same as the ``jonebit`` console script."""

import sys

from jonebit.cli import main

sys.exit(main())
