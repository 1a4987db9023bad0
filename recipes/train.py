"""Train a Llama-style model with FSDP/HSDP from the Hydra config in configs/train.yaml.

    torchrun --nproc_per_node=N recipes/train.py [hydra overrides, e.g. training.steps=50 parallel=hsdp]

Resumes from the latest complete checkpoint in ``checkpoint.folder`` (on any mesh shape).
``--cfg`` prints the composed config and exits; ``--help`` shows this text.
"""

from __future__ import annotations

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Run from a checkout whether or not (or however) the package is installed.
sys.path.insert(0, REPO)

import torch.distributed as dist  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from hyper_parallel.platform import init_distributed  # noqa: E402
from hyper_parallel.trainer import ConfigError, compose_config, run_training, validate_config  # noqa: E402

CONFIG_DIR = os.path.join(REPO, "configs")


def _fail(message: str) -> int:
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"error: {message}", file=sys.stderr, flush=True)
    return 2


def main(argv: list[str]) -> int:
    if "--help" in argv or "-h" in argv:
        print(__doc__)
        return 0
    try:
        cfg = compose_config([a for a in argv if a != "--cfg"], config_dir=CONFIG_DIR)
        dims = validate_config(cfg, int(os.environ.get("WORLD_SIZE", 1)))
    except ConfigError as err:
        return _fail(str(err))
    if "--cfg" in argv:
        print(OmegaConf.to_yaml(cfg))
        return 0
    platform = init_distributed()
    try:
        run_training(cfg, dims, platform)
    except ConfigError as err:
        # Bad data or config found after start-up (possibly on this rank only): one readable
        # line and exit; torchrun stops the other ranks. No process-group teardown (it could wait).
        os._exit(_fail(str(err)))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
