"""One errno table for the whole project.

Every layer raises :class:`FsError` (or a subclass) carrying a POSIX errno; the FUSE
layer turns it into ``pyfuse3.FUSEError`` and the CLI into a one-line message with an
exit code. Nothing else may be raised to a user.
"""
import errno as _errno


class FsError(Exception):
    """A filesystem error with a POSIX errno and a message for humans."""

    errno = _errno.EIO

    def __init__(self, message="", errno=None):
        super().__init__(message)
        if errno is not None:
            self.errno = errno

    def __str__(self):
        msg = super().__str__()
        return msg or _errno.errorcode.get(self.errno, str(self.errno))


def _make(name, code, doc):
    return type(name, (FsError,), {"errno": code, "__doc__": doc})


NotFound = _make("NotFound", _errno.ENOENT, "No such file, directory, key or name.")
Exists = _make("Exists", _errno.EEXIST, "The name is taken.")
NotDir = _make("NotDir", _errno.ENOTDIR, "A path component is not a directory.")
IsDir = _make("IsDir", _errno.EISDIR, "The operation needs a non-directory.")
NotEmpty = _make("NotEmpty", _errno.ENOTEMPTY, "The directory is not empty.")
NameTooLong = _make("NameTooLong", _errno.ENAMETOOLONG, "A name is longer than 255 bytes.")
Invalid = _make("Invalid", _errno.EINVAL, "An argument is invalid.")
ReadOnly = _make("ReadOnly", _errno.EROFS, "The tree is read-only (a snapshot).")
CrossDevice = _make("CrossDevice", _errno.EXDEV, "The operation crosses a branch boundary.")
TooBig = _make("TooBig", _errno.EFBIG, "The file would exceed the maximum file size.")
NoSpace = _make("NoSpace", _errno.ENOSPC, "Not enough devices or space to store the data.")
NoAttr = _make("NoAttr", _errno.ENODATA, "No such extended attribute.")
Range = _make("Range", _errno.ERANGE, "A value does not fit.")
Perm = _make("Perm", _errno.EPERM, "Operation not permitted.")
Access = _make("Access", _errno.EACCES, "Permission denied.")
NotSupported = _make("NotSupported", _errno.EOPNOTSUPP, "The operation is not supported.")
TooManyLinks = _make("TooManyLinks", _errno.EMLINK, "Too many links.")
Busy = _make("Busy", _errno.EBUSY, "The resource is busy.")
IOFailure = _make("IOFailure", _errno.EIO, "Data could not be read or written.")
Unavailable = _make("Unavailable", _errno.EIO, "The metadata store or too many devices are unreachable.")


class MetaDamaged(FsError):
    """A metadata record fails its checksum (``key``: which one), or the metadata store
    itself is damaged (``key`` None): EIO for the operation that read it, never content."""

    errno = _errno.EIO

    def __init__(self, message: str, key: bytes | None = None):
        super().__init__(message)
        self.key = key


class Conflict(Exception):
    """A transaction's compare-and-swap failed; the caller retries (see kv.transact)."""


class VolumeError(Exception):
    """A volume cannot be used (missing, foreign, wrong format revision, missing device).

    The CLI prints it as one line and exits with status 2.
    """


class DeviceError(Exception):
    """A device could not serve a request (a transport raises it: missing, down, an
    I/O error); ``dev`` names it, ``errno`` says why when the device said (ENOSPC: it
    is full), else None. The data client treats it as a lost fragment."""

    def __init__(self, dev: int, message: str, errno: int | None = None):
        super().__init__(f"device {dev}: {message}")
        self.dev, self.errno = dev, errno


class InUse(VolumeError):
    """The volume's metadata has one owner (a SQLite database) and another process
    holds it: a mount, a writing direct client, fsck."""


class InUseHere(InUse):
    """The volume's metadata has one owner (a SQLite database) and this process holds
    it already: another direct client of the volume opened here."""
