"""NumPy arrays that are views of a mapped file (.npy, or raw bytes with a dtype).

The array's memory is the file's mapping: nothing is read up front, pages are read when
touched, and np.shares_memory(a, np.frombuffer(a.mapping, np.uint8)) holds. Read-only
views map with ACCESS_READ (writing raises ValueError); writable ones with ACCESS_WRITE,
so stores go to the page cache and reach the file on flush() (msync) or eviction.

Caveat: close() and leaving a `with` block flush, but do not unmap: like numpy.memmap, the
mapping lives as long as any array or view of it does.
"""
import math
import os
import tokenize

import numpy as np
from numpy.lib import format as npy_format

from bmfs.typed.access import advise, check_mode
from bmfs.typed.errors import CorruptFile, NotSupportedHere, TypeMismatch, from_os_error

NPY_MAGIC = b"\x93NUMPY"
_NUMPY1 = int(np.__version__.split(".")[0]) < 2  # numpy 1 has no return_scalar
# What numpy's header reader raises on damaged bytes (it tokenizes a Python literal).
_HEADER_ERRORS = (ValueError, SyntaxError, TypeError, KeyError, EOFError, tokenize.TokenError)


class MappedArray(np.memmap):
    """A numpy.memmap that is also a context manager (exit flushes).

    Results of arithmetic and copies are plain ndarrays, as with numpy.memmap.
    """

    def __array_wrap__(self, arr, context=None, return_scalar=False):
        # numpy.memmap does this only for its exact type; subclasses must do it themselves.
        if arr is self:
            return arr
        arr = arr.view(np.ndarray)
        if return_scalar or (arr.ndim == 0 and _NUMPY1):
            return arr[()]
        return arr

    def __getitem__(self, index):
        res = super().__getitem__(index)
        if type(res) is MappedArray and res._mmap is None:
            return res.view(np.ndarray)
        return res

    @property
    def mapping(self):
        """The mmap.mmap this array is a view of."""
        return self._mmap

    def advise(self, access):
        """Read-ahead for the whole mapping: "normal" (or "auto": the kernel's default),
        "random" (a page fault reads its page only: for indexes that jump about) or
        "sequential" (bmfs.typed.access). Views of this array share the mapping, and
        the advice."""
        advise(self._mmap, "normal" if check_mode(access) == "auto" else access)

    def close(self):
        """Flush (see the module caveat: the mapping stays until the array is gone)."""
        self.flush()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.flush()


def is_npy(head):
    return bytes(head[:len(NPY_MAGIC)]) == NPY_MAGIC


def open_array(path, req, *, writable=False, offset=0):
    """Map `path` as an array according to Request `req` (kind npy, raw or array).

    Raises:
        TypeMismatch: the file is not of the requested dtype/shape, or a raw array has no
            dtype, or the size is not a whole number of items.
        CorruptFile: a damaged .npy header or a .npy shorter than its header says.
    """
    try:
        f = open(path, "r+b" if writable else "rb")
    except OSError as e:
        raise from_os_error(path, e) from None
    with f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(len(NPY_MAGIC))
        npy = req.kind == "npy" or (req.kind == "array" and is_npy(head))
        if npy:
            if not is_npy(head):
                raise TypeMismatch(path, f"not a .npy file: magic is {head!r}", 0)
            f.seek(0)
            dtype, shape, order, offset = _npy_header(f, path)
            _check_npy_against(path, req, dtype, shape)
        else:
            dtype, shape, order = _raw_layout(path, req, size, offset)
        nbytes = math.prod(shape) * dtype.itemsize
        if offset + nbytes > size:
            raise CorruptFile(path, f"truncated: {dtype} array of shape {shape} needs "
                                    f"{nbytes} bytes from offset {offset}, the file has "
                                    f"{size - offset}", size)
        if nbytes == 0:
            # mmap cannot map zero bytes; an empty array has no memory to share anyway.
            empty = np.empty(shape, dtype, order=order)
            empty.flags.writeable = writable
            return empty
        try:
            return MappedArray(f, dtype=dtype, mode="r+" if writable else "r",
                               offset=offset, shape=shape, order=order)
        except OSError as e:
            raise from_os_error(path, e) from None


def _npy_header(f, path):
    try:
        version = npy_format.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = npy_format.read_array_header_1_0(f)
        elif version == (2, 0):
            shape, fortran, dtype = npy_format.read_array_header_2_0(f)
        elif version == (3, 0) and hasattr(npy_format, "_read_array_header"):
            shape, fortran, dtype = npy_format._read_array_header(f, version)
        else:
            raise NotSupportedHere(path, f".npy format version {version} is not supported", 6)
    except _HEADER_ERRORS as e:
        raise CorruptFile(path, f"bad .npy header: {e}", 0) from None
    if dtype.hasobject:
        raise TypeMismatch(path, ".npy holds Python objects, which cannot be memory-mapped")
    return dtype, shape, "F" if fortran else "C", f.tell()


def _check_npy_against(path, req, dtype, shape):
    if req.dtype is not None and req.dtype != dtype:
        raise TypeMismatch(path, f".npy holds {dtype}, not {req.dtype}")
    if req.shape is not None and tuple(req.shape) != tuple(shape):
        raise TypeMismatch(path, f".npy has shape {shape}, not {req.shape}")


def _raw_layout(path, req, size, offset):
    if req.dtype is None:
        raise TypeMismatch(path, "a raw array needs a dtype: pass dtype= (and shape=), or "
                                 "record a type such as 'raw:<f4:100,3'")
    dtype = req.dtype
    if dtype.hasobject:
        raise TypeMismatch(path, "arrays of Python objects cannot be memory-mapped")
    available = size - offset
    if available < 0:
        raise TypeMismatch(path, f"offset {offset} is past the end of the file ({size})")
    if req.shape is None:
        if available % dtype.itemsize:
            raise TypeMismatch(path, f"{available} bytes is not a whole number of {dtype} "
                                     f"items ({dtype.itemsize} bytes each)", size)
        return dtype, (available // dtype.itemsize,), "C"
    shape = tuple(req.shape)
    need = math.prod(shape) * dtype.itemsize
    if need != available:
        raise TypeMismatch(path, f"shape {shape} of {dtype} is {need} bytes, the file has "
                                 f"{available} from offset {offset}")
    return dtype, shape, "C"
