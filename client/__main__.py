"""`python -m batchlm_client ...`: see client/cli.py."""

import sys

from batchlm_client.cli import main

sys.exit(main())
