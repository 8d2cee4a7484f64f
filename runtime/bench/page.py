"""What every Markdown page a benchmark writes is made of, importing neither onnxruntime nor the benchmarks: the
marked regions a page keeps (`<!-- bench:NAME -->` ... `<!-- /bench -->`), a table, and the machine's CPU."""
import platform
import re

REGION = re.compile(r"(<!-- bench:([a-z_]+) -->\n)(.*?)(<!-- /bench -->)", re.S)


def table(header, rows, left=1):
    """A Markdown table: `header` [str], `rows` [[str]]; the first `left` columns aligned left, figures right."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join([":---"] * left + ["---:"] * (len(header) - left)) + "|"]
    return lines + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]


def cpu():
    """The CPU's model name as the kernel reports it, and its widest vector extension (MLAS and OpenBLAS pick
    their kernels by it)."""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return platform.processor() or platform.machine()
    field = lambda key: next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith(key)), "")
    flags = field("flags").split()
    vector = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else ""
    return ", ".join(filter(None, [field("model name") or platform.machine(), vector]))


def check_region(path, name):
    """The page at `path`, or ValueError (one line) when it has no region `name` to rewrite (OSError: unreadable)."""
    with open(path, encoding="utf-8") as f:
        page = f.read()
    if not any(m.group(2) == name for m in REGION.finditer(page)):
        raise ValueError(f"{path}: no <!-- bench:{name} --> ... <!-- /bench --> region to rewrite")
    return page


def region_or_exit(parser, path, name):
    """check_region, before minutes of measuring rather than after: an unreadable page or one without the region is
    `parser`'s one-line error (exit 2)."""
    try:
        check_region(path, name)
    except (OSError, ValueError) as e:
        parser.error(str(e))


def rewrite_region(path, name, text):
    """Rewrite region `name` of the page at `path` with `text`, the rest of the page kept (check_region first)."""
    page = REGION.sub(lambda m: m.group(1) + text + m.group(4) if m.group(2) == name else m.group(0),
                      check_region(path, name))
    with open(path, "w", encoding="utf-8") as f:
        f.write(page)


def stamp(results):
    """The line under every table: the run it comes from."""
    quick = "; `--quick`" if results.get("quick") else ""
    return (f"*{results.get('date', '?')}, {results.get('cpu', '?')} ({results.get('cores', '?')} cores), "
            f"onnxruntime {results.get('onnxruntime', '?')}{quick}*")
