"""``python -m zerofuse.train`` (also how launch() starts each local rank)."""
import sys

from zerofuse.train import main

if __name__ == "__main__":
    sys.exit(main())
