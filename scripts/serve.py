#!/usr/bin/env python
"""Serve the model repository with a real tritonserver until a signal drains and stops it (`make serve`).

The same as `.venv/bin/batchlm-serve`; `--help` lists the options.
"""

import sys

from batchlm.launcher.serve import main

if __name__ == "__main__":
    sys.exit(main())
