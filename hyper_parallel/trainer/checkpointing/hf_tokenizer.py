"""The tokenizer of a run, next to its Hugging Face export: ``tokenizer.json`` and a
``tokenizer_config.json``, so ``transformers.AutoTokenizer.from_pretrained(dir)`` loads it."""

from __future__ import annotations

import json
import os
from typing import Dict, NamedTuple, Optional

from omegaconf import DictConfig

from hyper_parallel.utils.fileio import write_file_atomically
from hyper_parallel.data import load_tokenizer
from hyper_parallel.data.prepare import read_sidecar
from hyper_parallel.data.tokenizer import BYTES

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


class RunTokenizer(NamedTuple):
    """A run's ``tokenizer.json`` and its end-of-document token (the one joining documents)."""

    path: str
    eos_token: str
    eos_id: int


def run_tokenizer(run_cfg: DictConfig) -> Optional[RunTokenizer]:
    """The tokenizer a run trained with: ``data.tokenizer``, or for a token file without one the
    tokenizer its sidecar names. None for UTF-8 bytes, or when none is recorded.

    Raises:
        FileNotFoundError / ValueError: the recorded tokenizer is missing or unreadable.
    """
    data = run_cfg.data
    spec, eos_token = data.get("tokenizer"), data.get("eos_token")
    if not spec and data.kind == "tokens":
        spec = (read_sidecar(str(data.path)) or {}).get("tokenizer")
    if not spec or spec == BYTES:
        return None
    path = os.path.expanduser(str(spec))
    if os.path.isdir(path):
        path = os.path.join(path, TOKENIZER_FILE)
    tokenizer = load_tokenizer(path, eos_token)
    eos_id = int(tokenizer.separator[0])
    # An optional package (hyper_parallel[recipes]), imported here: load_tokenizer above required it.
    from tokenizers import Tokenizer

    return RunTokenizer(path, Tokenizer.from_file(path).id_to_token(eos_id), eos_id)


def write_tokenizer_files(tokenizer: RunTokenizer, out_dir: str, *, max_length: int) -> None:
    """Copy ``tokenizer.json`` to ``out_dir`` and write ``tokenizer_config.json``: the
    end-of-document token is both ``bos_token`` and ``eos_token`` (documents were joined by
    it alone, so it also precedes each one)."""
    with open(tokenizer.path, "rb") as f:
        write_file_atomically(os.path.join(out_dir, TOKENIZER_FILE), f.read())
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tokenizer.eos_token,
              "eos_token": tokenizer.eos_token, "model_max_length": max_length,
              "clean_up_tokenization_spaces": False}
    write_file_atomically(os.path.join(out_dir, TOKENIZER_CONFIG_FILE), json.dumps(config, indent=2).encode())


def special_token_ids(tokenizer: RunTokenizer) -> Dict[str, int]:
    """``bos_token_id`` / ``eos_token_id`` for the model's ``config.json``."""
    return {"bos_token_id": tokenizer.eos_id, "eos_token_id": tokenizer.eos_id}
