"""What a session holds, as the report counts it: copies under onnxruntime's default SessionOptions
(prepacked ones included) and with prepacking off, with the bytes measured after one run."""
from runtime.resident import copies_held

SETTINGS = {"defaults": True, "no_prepacking": False}  # name in the report -> prepacking on

DEFAULTS = ("defaults",)  # the settings a run measures unless --verbose, the only report that shows the other


def measured_settings(verbose):
    """The SETTINGS a run measures, each in a child of its own: every one under --verbose, else the defaults."""
    return tuple(SETTINGS) if verbose else DEFAULTS

NO_PREPACKING = "session.disable_prepacking=1"  # the setting that changes it, as a user writes it

RESOLUTION = 16 * 2**20  # below this a table's ratio is not given: a session's own pages (~3 MiB) would swamp it


def copies(n):
    """'1 copy', 'N copies': how every line says a count of copies."""
    return f"{n} cop{'y' if n == 1 else 'ies'}"


def times(n):
    """'once', 'twice', 'N times'."""
    return "once" if n == 1 else "twice" if n == 2 else f"{n} times"


def human(n):
    """`n` bytes as a person reads them: '512 bytes', '32.0 KiB', '147.2 MiB', '2.96 GiB' (exact bytes: --json)."""
    if n is None:
        return "?"
    for unit, size, digits in (("GiB", 2**30, 2), ("MiB", 2**20, 1), ("KiB", 2**10, 1)):
        if abs(n) >= size:
            return f"{n / size:.{digits}f} {unit}"
    return f"{n} byte{'' if n == 1 else 's'}"


COPIES = ("duplicate", "transposed_duplicate")  # the relations that store a table's values a second time


def stored_copies(pairs, table):
    """(how many times a file stores `table`: itself and each head holding a (transposed) duplicate of it, a head
    that several branches read once; the bytes those heads take)."""
    heads = {p.head: p.wasted_bytes for p in pairs if p.table == table and p.relation in COPIES}
    return 1 + len(heads), sum(heads.values())


def not_counted():
    """The `in_memory` entry of a table when onnxruntime was not run (--static): every figure null."""
    return {setting: held(None, None, 1, 0) for setting in SETTINGS}


def in_memory(names, table_bytes, other_bytes, optimized, prepacked, measured):
    """The `in_memory` entry of one table: per setting, copies counted and bytes measured, and times_table =
    (resident growth - the model's other initializers) / the table's bytes, None for a table under RESOLUTION."""
    return {setting: held(copies_held(names, optimized.proto, prepacked, prepacking), measured.get(setting),
                          table_bytes, other_bytes) for setting, prepacking in SETTINGS.items()}


def held(copies, figures, table_bytes, other_bytes):
    """One setting's entry of `in_memory`: `copies`, and the measured `figures` (None: not measured, or not asked
    for: prepacking off outside --verbose) with their times_table."""
    if figures is None:
        return {"copies": copies, "resident_bytes": None, "anonymous_bytes": None, "file_bytes": None, "peak_bytes": None,
                "kept_bytes": None, "times_table": None}
    return {"copies": copies, **figures, "times_table": (round((figures["resident_bytes"] - other_bytes) / table_bytes, 2)
                                                        if table_bytes >= RESOLUTION else None)}
