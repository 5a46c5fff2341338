"""``python -m lily.selftest``: see lily.selftest."""

import sys

from lily.selftest.runner import main

sys.exit(main())
