"""The docs' examples do what they say: each command of "resuming on another mesh" trains
steps of its own, and the fully_shard snippets run on the platform's device (not CUDA only)."""

from __future__ import annotations

import os
import re
import shlex

from hyper_parallel.trainer import compose_config
from tests.recipes.launch import REPO


def _read(name):
    with open(os.path.join(REPO, "docs", name)) as f:
        return f.read()


def test_each_command_of_the_resume_on_another_mesh_example_trains_steps_of_its_own():
    section = _read("recipes.md").split("## Checkpoints and resuming on another mesh", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    done, ranges = 0, []
    for line in block.strip().splitlines():
        words = shlex.split(line, comments=True)
        cfg = compose_config([w for w in words[words.index("recipes/train.py") + 1:]])
        t = cfg.training
        end = t.steps if t.stop_after_steps is None else min(t.steps, done + t.stop_after_steps)
        ranges.append((done, end))
        done = end
    assert len(ranges) == 3 and all(start < end for start, end in ranges), ranges
    assert done == 100


def test_fully_shard_snippets_do_not_hard_code_cuda():
    snippets = "\n".join(re.findall(r"```python\n(.*?)```", _read("fully_shard.md"), re.S))
    assert not re.search(r"""(init_device_mesh\(|device=)\s*["']cuda""", snippets), \
        "use hp.get_platform().device_type / current_device() so the snippet runs on CPU too"


def test_the_128k_context_command_validates_on_8_ranks_with_8k_tokens_per_rank():
    from hyper_parallel.trainer import validate_config

    section = _read("recipes.md").split("**Memory arithmetic: a 128k sequence on the 8B preset.**", 1)[1]
    command = re.search(r"```bash\n(.*?)```", section, re.S).group(1).replace("\\\n", " ")
    words = shlex.split(command)
    valid = validate_config(compose_config(words[words.index("recipes/train.py") + 1:]), 8)
    t = valid.cfg.training
    assert valid.dims.cp == 8 and valid.dims.dp_size == 1 and t.seq_len == 131072
    assert t.global_batch_size // valid.dims.dp_size // t.grad_accum_steps == 1  # one sequence per micro-batch
    assert valid.cfg.model.rope_scaling is not None
