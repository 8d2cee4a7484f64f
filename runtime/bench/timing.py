"""How the bench times things: interleaved rounds, minimum over repeats, sessions with the Runner's settings."""
import sys
import time


from runtime.progress import Progress
from runtime.resident import resident
from runtime.runner import bind, open_session, session_options


_LIVE = Progress(enabled=True)  # a refreshed line on a terminal, nothing otherwise


def progress(message):
    """One line on stderr: a figure as it is measured (the report goes to stdout)."""
    _LIVE.done()
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def stage(what=None):
    """Say on the refreshed line (a terminal only) what is being measured now, until the next figure; with no
    argument, clear the line."""
    if what is None:
        _LIVE.done()
    else:
        _LIVE(what)


def race(fns, budget, rounds=5):
    """Seconds per call of each function: the minimum over `rounds` rounds, the contenders interleaved in every
    round, so a slow spell on this shared machine hits all of them rather than one (noise only adds time)."""
    return {name: min(times) for name, times in race_rounds(fns, budget, rounds).items()}


def race_rounds(fns, budget, rounds=5, settle=0.0):
    """race()'s measurements, round by round: {name: [seconds per call in each round]}, so a ratio can be taken
    within each round (both sides under the same load) and its spread shown. `settle`: seconds of rest before
    each contender's turn, so the threads the one before left spinning (OpenBLAS's spin for about 0.1 s after a
    call, onnxruntime's briefly) have gone quiet and do not take its cores."""
    loops = {}
    for name, fn in fns.items():
        fn()  # warm: first-run allocations and page faults are not the steady state
        start = time.perf_counter()
        fn()
        loops[name] = max(1, int(budget / rounds / len(fns) / max(time.perf_counter() - start, 1e-7)))
    seen = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            time.sleep(settle)
            start = time.perf_counter()
            for _ in range(loops[name]):
                fn()
            seen[name].append((time.perf_counter() - start) / loops[name])
    return seen


def same_round_ratio(rounds, a, b):
    """(median, [lowest, highest]) of a's time over b's within each round of race_rounds(): both measured under
    the same load, so a slow spell moves the spread, not the verdict (judge on the median)."""
    ratios = sorted(x / y for x, y in zip(rounds[a], rounds[b]))
    return ratios[len(ratios) // 2], [ratios[0], ratios[-1]]


def best_time(fn, budget):
    """race() for one function."""
    return race({"fn": fn}, budget)["fn"]


def session(model, prepacking=True, arena=False):
    """An onnxruntime session on a ModelProto or a path with the Runner's settings (one of them flipped if asked)."""
    return open_session(model, session_options(prepacking=prepacking, arena=arena))


def bound_run(sess, feeds, outputs):
    """A zero-copy run: inputs and preallocated outputs bound once, as a serving loop would."""
    binding = bind(sess, feeds, list(outputs), outputs)
    keep = (feeds, outputs)  # onnxruntime holds raw pointers into these arrays: they must outlive the binding
    return lambda: sess.run_with_iobinding(binding) or keep


def rss():
    """This process's resident bytes."""
    return resident().rss
