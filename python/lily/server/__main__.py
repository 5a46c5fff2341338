import sys

from lily.server.app import main

sys.exit(main())
