import sys

from tokenfleet.cli import main

sys.exit(main())
