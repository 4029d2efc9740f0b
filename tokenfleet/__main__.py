import sys

from tokenfleet.cli import main

if __name__ == "__main__":  # an engine process (multiprocessing spawn) imports this module without running it
    sys.exit(main())
