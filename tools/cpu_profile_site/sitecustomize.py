"""Put on PYTHONPATH (after the tree) to profile every `kvgate serve` started with
KVGATE_CPU_PROFILE=DIR on its CPU clock (`tools.cpu_profile`); any other process is untouched."""

import os
import sys

if os.environ.get("KVGATE_CPU_PROFILE") and "serve" in sys.argv:
    from tools.cpu_profile import ENV, install

    install(os.environ[ENV])
