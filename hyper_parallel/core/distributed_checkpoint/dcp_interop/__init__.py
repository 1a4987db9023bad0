"""Interop with torch DCP (``torch.distributed.checkpoint``) checkpoints, e.g. torchtitan's:
``load`` reads them directly (:class:`DcpReader`), ``import_dcp`` converts one into ours,
``export_dcp`` converts ours into one. DCP's pickled metadata is read with a restricted
unpickler that admits only DCP's own metadata classes (``unpickler.py``).

May import ``_torch_compat`` (DCP's private metadata classes), ``utils`` and the rest of
``distributed_checkpoint``; nothing above it imports it but ``api``'s readers and the CLI.
"""

from hyper_parallel.core.distributed_checkpoint.dcp_interop.convert import export_dcp, import_dcp, map_keys
from hyper_parallel.core.distributed_checkpoint.dcp_interop.reader import DcpReader, is_dcp_checkpoint
from hyper_parallel.core.distributed_checkpoint.dcp_interop.unpickler import read_dcp_metadata

__all__ = ["DcpReader", "export_dcp", "import_dcp", "is_dcp_checkpoint", "map_keys", "read_dcp_metadata"]
