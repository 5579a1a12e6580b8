"""PyInstaller entry point of the bundled `warmslot` command line (core.cli:main)."""

import multiprocessing
import sys

from core.cli.main import main

if __name__ == "__main__":
    multiprocessing.freeze_support()
    sys.exit(main())
