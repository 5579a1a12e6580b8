"""PyInstaller runtime hook: child processes get the user's library path.

On Linux the bootloader puts the bundle's ``_internal/`` on ``LD_LIBRARY_PATH``
(saving any earlier value in ``LD_LIBRARY_PATH_ORIG``). Left there, every
program Warmslot starts — llama-server, cmake/git/compilers for `warmslot
build`, the file manager opened from the tray — would load the bundle's copies
of libstdc++, OpenSSL, glib and Qt instead of the system's. The dynamic loader
read the variable once at start-up, so restoring it here changes nothing for
this process, only for its children (llama-server's own libraries are added
back by core.server.discover for the bundled binary).
"""

import os
import sys

if sys.platform.startswith("linux") and getattr(sys, "frozen", False):
    _orig = os.environ.pop("LD_LIBRARY_PATH_ORIG", None)
    if _orig is not None:
        os.environ["LD_LIBRARY_PATH"] = _orig
    else:
        os.environ.pop("LD_LIBRARY_PATH", None)
