"""python -m runtime.bench [--quick] [--json PATH] [--markdown FILE] [--plot FILE.png]: memory and speed at real
vocabulary sizes.

Every figure is a ratio to a baseline measured in the same run (numpy take, numpy's matmul in a clean child
process, the table's own bytes), so it means the same on a loaded machine. Times are the minimum over repeats
(noise only ever adds time). Progress goes to stderr, the table to stdout. Modules: `timing` (how things are
timed), `lookups` (a, b), `head` (c, e), `memory` (d), `formats` (d'), `probes` (the fresh processes), `report`,
`markdown` (--markdown's tables, each with the run's date and machine), `cli`.
"""
from runtime.bench.cli import main
from runtime.bench.head import bench_floor, bench_head
from runtime.bench.lookups import WIDTH, bench_format_lookups, bench_lookups
from runtime.bench.formats import bandwidth, bench_formats
from runtime.bench.memory import bench_memory
from runtime.bench.report import report, targets
from runtime.bench.timing import bound_run, race, session

__all__ = ["main", "bench_floor", "bench_head", "WIDTH", "bench_format_lookups", "bench_lookups",
           "bandwidth", "bench_formats", "bench_memory", "report", "targets", "bound_run", "race", "session"]
