"""What a shipped folder costs the process that loads it, before and after `inspect --retie`, and what inspect
itself costs against the sessions it must open: a benchmark on folders you exported (tests/fixtures/
make_real_size_folders.py makes the T5- and Marian-shaped ones the README quotes).

    ./lab_env/python -m runtime.bench.folders FOLDER [FOLDER ...]

For each folder, in this run: `inspect FOLDER --json` timed; the client's sessions (every file inspect chooses,
all held in one process, one process per setting, as inspect measures them) timed alone; `--retie` into a scratch
folder; the retied folder inspected. Printed: the Pss one process holding every session grows by after a run of
each, under onnxruntime's default SessionOptions, before and after, each over the distinct weight bytes (every
stored tensor once: the table plus the other weights), the bytes on disk, and inspect's time over the sessions'.
"""
import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

from runtime.bench import page
from runtime.inspect.examine_folder import inspect_folder
from runtime.model.findings.across import disk_bytes
from runtime.inspect.sandbox import isolated, jobs, memory

TARGET = 1.15  # the retied folder's Pss growth over its distinct weight bytes, at most
COST = 1.3  # inspect's time over the sessions it must open, at most


def _inspect(*args):
    """(seconds, parsed --json) of `python -m runtime.inspect ARGS --json` in a fresh process."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "runtime.inspect", *map(str, args), "--json"], capture_output=True,
                          text=True, check=False)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"inspect {' '.join(map(str, args))} failed: {done.stderr.strip()[-300:]}")
    return seconds, json.loads(done.stdout)


def _sessions(folder, scratch):
    """(seconds, figures): the client's sessions on `folder` opened and run once, one child per setting, every
    file in that child (memory.measure_together, as inspect runs it), timed alone."""
    result = inspect_folder(folder, scratch, isolated.Limits(), static=True)
    parts = [jobs.part(jobs.user_model(it["model"].checked), it["info"].rows, it["info"].shape)
             for it in result["items"] if it["info"].rows]
    together = os.path.join(scratch, "sessions")
    os.mkdir(together)
    start = time.perf_counter()
    figures = memory.measure_together(parts, together, isolated.Limits(), sum(it["model"].file_bytes
                                                                               for it in result["items"]))
    return time.perf_counter() - start, figures, result


def _distinct_bytes(result):
    """Every tensor the client's files store, once: a data file's bytes two files name counted once."""
    seen = {}
    for item in result["items"]:
        for name, tensor in item["model"].tensors.items():
            seen[tensor.external or (item["file"], name)] = tensor.nbytes
    return sum(seen.values())


def _token(found):
    return next(v for v in found["across_files"]["vocabulary"] if v["kind"] == "token")


def measure(folder):
    """One folder's figures, all from this run."""
    with tempfile.TemporaryDirectory() as scratch:
        inspect_s, before = _inspect(folder)
        os.mkdir(os.path.join(scratch, "a"))
        sessions_s, _, exported = _sessions(folder, os.path.join(scratch, "a"))
        out = os.path.join(scratch, "retied")
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "runtime.inspect", folder, "--retie", out], capture_output=True,
                              text=True, check=False)
        retie_s = time.perf_counter() - start
        if done.returncode != 0:
            raise SystemExit(f"inspect --retie {folder} failed: {(done.stdout + done.stderr).strip()[-300:]}")
        _, after = _inspect(out)
        os.mkdir(os.path.join(scratch, "b"))
        _, _, retied = _sessions(out, os.path.join(scratch, "b"))
        table = _token(before)
        weights = _distinct_bytes(retied)
        was, now = (_token(found)["in_memory"]["defaults"] for found in (before, after))
        return {"folder": folder, "table": f"{table['vocab_size']} x {table['width']} {table['format']}",
                "table_bytes": table["bytes"], "distinct_weight_bytes": weights,
                "copies_on_disk": [_token(before)["copies_on_disk"], _token(after)["copies_on_disk"]],
                "copies_in_memory": [was["copies"], now["copies"]],
                "pss_bytes": [was["resident_bytes"], now["resident_bytes"]],
                "times_weights": [round(was["resident_bytes"] / weights, 2), round(now["resident_bytes"] / weights, 2)],
                "disk_bytes": [disk_bytes(exported["items"]), disk_bytes(retied["items"])],
                "inspect_s": round(inspect_s, 2), "sessions_s": round(sessions_s, 2), "retie_s": round(retie_s, 2),
                "inspect_over_sessions": round(inspect_s / sessions_s, 2), "onnxruntime": before["onnxruntime"]}


def _line(r):
    mib = lambda b: f"{b / 2**20:.0f}"
    return (f"{os.path.basename(r['folder'].rstrip('/'))}: table {r['table']}; Pss of the client's sessions "
            f"{mib(r['pss_bytes'][0])} -> {mib(r['pss_bytes'][1])} MiB = {r['times_weights'][0]} -> "
            f"{r['times_weights'][1]}x the distinct weights ({mib(r['distinct_weight_bytes'])} MiB; target <= "
            f"{TARGET}: {'met' if r['times_weights'][1] <= TARGET else 'MISSED'}); on disk {mib(r['disk_bytes'][0])} "
            f"-> {mib(r['disk_bytes'][1])} MiB, the table stored {r['copies_on_disk'][0]} -> {r['copies_on_disk'][1]} "
            f"time(s); inspect {r['inspect_s']} s = {r['inspect_over_sessions']}x the sessions it must open "
            f"({r['sessions_s']} s; target <= {COST}: {'met' if r['inspect_over_sessions'] <= COST else 'MISSED'})")


def markdown(results, onnxruntime, seconds):
    """The region's text: one row per folder, then the run's date and machine."""
    mib = lambda b: f"{b / 2**20:.1f}"
    rows = [[os.path.basename(r["folder"].rstrip("/")), r["table"], f"{mib(r['pss_bytes'][0])} ({r['copies_in_memory'][0]})",
             f"{mib(r['pss_bytes'][1])} ({r['copies_in_memory'][1]})", mib(r["distinct_weight_bytes"]),
             f"{r['times_weights'][0]:.2f} → {r['times_weights'][1]:.2f}",
             f"{mib(r['disk_bytes'][0])} → {mib(r['disk_bytes'][1])} ({r['copies_on_disk'][0]} → {r['copies_on_disk'][1]})",
             f"{r['inspect_s']:.1f} / {r['sessions_s']:.1f} = {r['inspect_over_sessions']:.2f}×"] for r in results]
    lines = page.table(["folder", "table", "Pss MiB before (copies)", "after (copies)", "distinct weights MiB",
                        "Pss / weights", "on disk MiB (table stored)", "inspect s / sessions s"], rows, left=2)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")
    return "\n".join(lines) + (f"\n\n*{date}, {page.cpu()} ({os.cpu_count()} cores), onnxruntime {onnxruntime}; "
                               f"`python -m runtime.bench.folders`, {seconds / 60:.1f} minutes; targets: Pss / "
                               f"weights after <= {TARGET}, inspect <= {COST}x the sessions*\n")


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m runtime.bench.folders", description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", metavar="FOLDER", help="an exported model folder (Optimum's layout)")
    parser.add_argument("--json", action="store_true", help="one JSON object per folder instead of a line")
    parser.add_argument("--markdown", metavar="FILE",
                        help="also rewrite FILE's <!-- bench:folders --> region with the run's table")
    args = parser.parse_args(argv)
    for folder in args.folders:
        if not os.path.isdir(folder):
            parser.error(f"{folder}: not a folder")
    if args.markdown:
        try:
            page.check_region(args.markdown, "folders")  # refused before minutes of measuring, not after
        except OSError as e:
            parser.error(f"--markdown {args.markdown}: {e.strerror or e}")
        except ValueError as e:
            parser.error(str(e))
    began, results = time.perf_counter(), []
    for folder in args.folders:
        results.append(measure(folder))
        print(json.dumps(results[-1]) if args.json else _line(results[-1]), flush=True)
    if args.markdown:
        page.rewrite_region(args.markdown, "folders", markdown(results, results[0]["onnxruntime"],
                                                               time.perf_counter() - began))
    return 0


if __name__ == "__main__":
    sys.exit(main())
