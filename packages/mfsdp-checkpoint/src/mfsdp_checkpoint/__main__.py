"""``python -m mfsdp_checkpoint``: the ``mfsdp-checkpoint`` command without installing it."""

import sys

from mfsdp_checkpoint.cli import main

sys.exit(main())
