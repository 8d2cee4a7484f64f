"""Large arrays to and from files without holding them: copied file to file by the kernel where they are a memory
map's contiguous bytes, else written a block at a time, and the pages of a memory map let go once they are read."""
import mmap
import os

import numpy as np


def write_array(f, array, tensor, chunk=16 * 2**20):
    """Write `array`'s bytes in C order, a block of leading-axis slices at a time (a view is copied one block at a
    time, never whole); it must match the shell's dims."""
    if list(array.shape) != list(tensor.dims) and array.size * array.itemsize != 0:
        if not (array.ndim == 1 and array.dtype == np.uint8):  # stored bytes of a packed type: sized by the caller
            raise ValueError(f"initializer {tensor.name!r}: data of shape {list(array.shape)} for dims {list(tensor.dims)}")
    if _copied_in_kernel(f, array):
        return
    array = array.reshape(1, -1) if array.ndim == 0 else array
    rows = max(1, chunk // max(1, array[:1].nbytes))
    for start in range(0, len(array), rows):
        block = array[start:start + rows]
        prefetch(block)
        f.write(np.ascontiguousarray(block).data)
        if block.flags.c_contiguous:  # its own pages: let them go as it goes (a transposed view's span them all)
            release(block)
    release(array)


def file_range(array):
    """(path, offset, length) of the bytes of `array` in the file it is memory-mapped from (np.memmap's, by the
    name it was opened by), where it is a C-contiguous view of one; else None."""
    root = array
    while root is not None and not (isinstance(root, np.memmap) and isinstance(root.base, mmap.mmap)):
        root = getattr(root, "base", None)
    if root is None or not array.flags.c_contiguous or not array.nbytes or root.filename is None:
        return None
    low = np.lib.array_utils.byte_bounds(array)[0] - np.lib.array_utils.byte_bounds(root)[0]
    return root.filename, root.offset + low, array.nbytes


def _copied_in_kernel(f, array):
    """Whether `array`'s bytes were appended to the file object `f` at its position by copy_file_range, from the
    file it maps (file_range): nothing is mapped into this process, nor copied through it (4x faster than writing
    from the map). False, nothing written, where it is not such a view or the kernel cannot copy between them."""
    where = file_range(array)
    if where is None or not hasattr(os, "copy_file_range"):
        return False
    path, offset, length = where
    f.flush()
    position = f.tell()
    try:
        with open(path, "rb") as source:
            done = 0
            while done < length:
                n = os.copy_file_range(source.fileno(), f.fileno(), length - done, offset + done, position + done)
                if n == 0:  # the file is shorter than the map said: written another way (and then it fails)
                    raise OSError("short copy")
                done += n
    except OSError:
        f.seek(position)
        f.truncate()
        return False
    f.seek(position + length)
    return True


def _mapped(array):
    """The mmap.mmap `array` is a view of, and the page-aligned (start, length) of the bytes it spans there; None
    for an array in memory (or of nothing)."""
    base = array
    while base is not None and not isinstance(base, mmap.mmap):
        base = getattr(base, "base", None)  # a view -> its np.memmap -> the mmap.mmap it maps
    if base is None or base.closed or array.size == 0:
        return None
    low, high = np.lib.array_utils.byte_bounds(array)
    start = np.lib.array_utils.byte_bounds(np.frombuffer(base, np.uint8))[0]
    first = (low - start) // mmap.PAGESIZE * mmap.PAGESIZE  # whole pages: a page shared with a neighbour goes too
    return base, first, min(len(base), high - start) - first


def prefetch(array):
    """Ask for the pages `array` spans, where it is memory-mapped, to be read ahead at once (MADV_WILLNEED), before
    it is read through: read page by page, a mapped file faults each page in alone (writing 0.5 GB from a map took
    4x as long). Nothing for an array in memory."""
    mapped = _mapped(array)
    if mapped is not None:
        base, first, length = mapped
        base.madvise(mmap.MADV_WILLNEED, first, length)


def release(array):
    """Let the pages `array` spans go from this process, where it is memory-mapped (or a view of a memory map);
    they stay in the page cache, and are read again from it if the array is. A mapping that keeps them counts them
    in the process's resident memory for as long as the array lives: a table written, or compared, once would be
    held beside the sessions that run it. Nothing for an array in memory."""
    mapped = _mapped(array)
    if mapped is not None:
        base, first, length = mapped
        base.madvise(mmap.MADV_DONTNEED, first, length)
