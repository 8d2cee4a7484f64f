"""What a session holds, as the report counts it: copies under onnxruntime's default SessionOptions
(prepacked ones included) and with prepacking off, with the bytes measured after one run."""
from runtime.resident import copies_held

SETTINGS = {"defaults": True, "no_prepacking": False}  # name in the report -> prepacking on

NO_PREPACKING = "session.disable_prepacking=1"  # the setting that changes it, as a user writes it

RESOLUTION = 16 * 2**20  # below this a table's ratio is not given: a session's own pages (~3 MiB) would swamp it


def copies(n):
    """'1 copy', 'N copies': how every line says a count of copies."""
    return f"{n} cop{'y' if n == 1 else 'ies'}"


def not_counted():
    """The `in_memory` entry of a table when onnxruntime was not run (--static): every figure null."""
    return {setting: held(None, None, 1, 0) for setting in SETTINGS}


def in_memory(names, table_bytes, other_bytes, optimized, prepacked, measured):
    """The `in_memory` entry of one table: per setting, copies counted and bytes measured, and times_table =
    (resident growth - the model's other initializers) / the table's bytes, None for a table under RESOLUTION."""
    return {setting: held(copies_held(names, optimized.proto, prepacked, prepacking), measured.get(setting),
                          table_bytes, other_bytes) for setting, prepacking in SETTINGS.items()}


def held(copies, figures, table_bytes, other_bytes):
    """One setting's entry of `in_memory`: `copies`, and the measured `figures` (None: not measured) with their
    times_table."""
    if figures is None:
        return {"copies": copies, "resident_bytes": None, "anonymous_bytes": None, "file_bytes": None, "peak_bytes": None,
                "times_table": None}
    return {"copies": copies, **figures, "times_table": (round((figures["resident_bytes"] - other_bytes) / table_bytes, 2)
                                                        if table_bytes >= RESOLUTION else None)}
