"""What inspect says about untrusted text: its one error type, names made printable, a tensor type named."""
import unicodedata

from onnx import TensorProto


class InspectError(Exception):
    """Bad input or a model that cannot be read safely: one line on stderr, exit 2."""


_UNSAFE = ("Cc", "Cf", "Zl", "Zp", "Cs", "Co", "Cn")  # controls, format marks, line breaks, surrogates, unassigned


def printable(text):
    """`text` with every control, format, line-separator, surrogate or unassigned character written as an escape
    (\\x1b, \\u2028), one final newline kept: a name in the model cannot move the cursor, set a window title or
    forge a report line."""
    end = "\n" if text.endswith("\n") else ""
    body = text[:len(text) - len(end)]
    return "".join(c.encode("unicode_escape").decode("ascii") if unicodedata.category(c) in _UNSAFE else c
                   for c in body) + end


def field(text, most=64):
    """`text` as one field of a report line: printable(), a final newline escaped too (nothing from a file starts a
    line), and cut to `most` characters where longer, with its length said."""
    shown = printable(text + "\n")[:-1]
    return shown if len(shown) <= most else f"{shown[:most]}... ({len(text)} characters)"


def type_name(tensor):
    """A TensorProto's data type as ONNX names it (FLOAT16), or its number where ONNX names none."""
    return TensorProto.DataType.Name(tensor.data_type) if tensor.data_type in TensorProto.DataType.values() \
        else str(tensor.data_type)
