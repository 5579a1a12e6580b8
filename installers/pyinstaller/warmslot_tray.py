"""PyInstaller entry point of the bundled `warmslot-tray` app (app.main:main)."""

import multiprocessing
import sys

from app.main import main

if __name__ == "__main__":
    multiprocessing.freeze_support()
    sys.exit(main())
