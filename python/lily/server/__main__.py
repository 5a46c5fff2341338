import sys

from lily.server.command import main

sys.exit(main())
