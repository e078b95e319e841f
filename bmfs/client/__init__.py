"""The direct client: a volume opened in the calling process, no mount (docs/client.md).

``bmfs.connect(volume, branch=...)`` returns a :class:`Client`; ``fsspec.filesystem(
"bm", volume=...)`` is the same over fsspec (fsspec_fs.py).
"""
from .direct import Client, File, StatResult, connect

__all__ = ["Client", "File", "StatResult", "connect"]
