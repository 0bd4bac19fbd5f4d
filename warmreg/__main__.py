"""``python -m warmreg`` (also under ``torchrun``)."""

from __future__ import annotations

import sys

from .cli.main import main

sys.exit(main())
