"""The checkpoint format: metadata and its chunk/storage tables, safetensors headers, stored
values, checksums, validation and box geometry. Pure data and file-format code: no process
group, no threads; imports nothing else of the package but ``errors`` and ``_fileio``.

May import ``errors`` and ``_fileio`` of the package only.
"""
