"""Errors of typed views. Each names the file and, where there is one, the byte offset.

They subclass the project's errno table (bmfs.errors), so the CLI prints them as one line
and the FUSE layer could map them to an errno.
"""
import errno as _errno

from bmfs import errors


class _Located:
    """Mixin: a message prefixed with the path and followed by the offset."""

    def __init__(self, path, message, offset=None):
        self.path = None if path is None else str(path)
        self.offset = offset
        text = f"{self.path}: {message}" if self.path else message
        if offset is not None:
            text += f" (at offset {offset})"
        super().__init__(text)


class TypeMismatch(_Located, errors.Invalid):
    """The file's content or recorded type is not the type asked for (EINVAL)."""


class BadTypeString(_Located, errors.Invalid):
    """A type string such as 'proto:pkg.Msg' is malformed (EINVAL)."""


class UnknownSchema(_Located, errors.Invalid):
    """A type names a message or table that no loaded schema defines (EINVAL)."""


class CorruptFile(_Located, errors.IOFailure):
    """The file is truncated or its bytes contradict its format (EIO)."""


class MissingIndex(CorruptFile):
    """A record file has no footer and index: its writer did not finish (EIO)."""


class NoType(_Located, errors.NoAttr):
    """No type was given, none is recorded with the file and none can be read from it."""


class NotSupportedHere(_Located, errors.NotSupported):
    """The operation does not apply to this type or filesystem (EOPNOTSUPP)."""


def from_os_error(path, err):
    """Translate an OSError about `path` into the project's FsError with the same errno."""
    cls = {_errno.ENOENT: errors.NotFound, _errno.EACCES: errors.Access,
           _errno.EPERM: errors.Perm, _errno.EISDIR: errors.IsDir,
           _errno.ENOTDIR: errors.NotDir}.get(err.errno, errors.FsError)
    return cls(f"{path}: {err.strerror or err}", errno=err.errno)
