"""``python -m hyper_parallel.checkpoint inspect|verify|export-hf DIR ...`` (see ``cli.py``)."""

from hyper_parallel.core.distributed_checkpoint.cli import main

raise SystemExit(main())
