"""Large arrays to and from files without holding them: written a block at a time, and the pages of a memory map
let go once they are read."""
import mmap

import numpy as np


def write_array(f, array, tensor, chunk=16 * 2**20):
    """Write `array`'s bytes in C order, a block of leading-axis slices at a time (a view is copied one block at a
    time, never whole); it must match the shell's dims."""
    if list(array.shape) != list(tensor.dims) and array.size * array.itemsize != 0:
        if not (array.ndim == 1 and array.dtype == np.uint8):  # stored bytes of a packed type: sized by the caller
            raise ValueError(f"initializer {tensor.name!r}: data of shape {list(array.shape)} for dims {list(tensor.dims)}")
    array = array.reshape(1, -1) if array.ndim == 0 else array
    rows = max(1, chunk // max(1, array[:1].nbytes))
    for start in range(0, len(array), rows):
        block = array[start:start + rows]
        f.write(np.ascontiguousarray(block).data)
        if block.flags.c_contiguous:  # its own pages: let them go as it goes (a transposed view's span them all)
            release(block)
    release(array)


def release(array):
    """Let the pages `array` spans go from this process, where it is memory-mapped (or a view of a memory map);
    they stay in the page cache, and are read again from it if the array is. A mapping that keeps them counts them
    in the process's resident memory for as long as the array lives: a table written, or compared, once would be
    held beside the sessions that run it. Nothing for an array in memory."""
    base = array
    while base is not None and not isinstance(base, mmap.mmap):
        base = getattr(base, "base", None)  # a view -> its np.memmap -> the mmap.mmap it maps
    if base is None or base.closed or array.size == 0:
        return
    low, high = np.lib.array_utils.byte_bounds(array)
    start = np.lib.array_utils.byte_bounds(np.frombuffer(base, np.uint8))[0]
    first = (low - start) // mmap.PAGESIZE * mmap.PAGESIZE  # whole pages: a page shared with a neighbour goes too
    base.madvise(mmap.MADV_DONTNEED, first, min(len(base), high - start) - first)
