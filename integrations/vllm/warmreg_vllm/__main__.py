"""``python -m warmreg_vllm``: the ``warmreg-vllm`` command (:mod:`warmreg_vllm.cli`)."""

from .cli import main

raise SystemExit(main())
