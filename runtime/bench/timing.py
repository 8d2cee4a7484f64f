"""How the bench times things: interleaved rounds, minimum over repeats, sessions with the Runner's settings."""
import sys
import time


from runtime.resident import resident
from runtime.runner import bind, open_session, session_options


def progress(message):
    """One line on stderr: the bench's progress (the report goes to stdout)."""
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def race(fns, budget, rounds=5):
    """Seconds per call of each function: the minimum over `rounds` rounds, the contenders interleaved in every
    round, so a slow spell on this shared machine hits all of them rather than one (noise only adds time)."""
    return {name: min(times) for name, times in race_rounds(fns, budget, rounds).items()}


def race_rounds(fns, budget, rounds=5):
    """race()'s measurements, round by round: {name: [seconds per call in each round]}, so a ratio can be taken
    within each round (both sides under the same load) and its spread shown."""
    loops = {}
    for name, fn in fns.items():
        fn()  # warm: first-run allocations and page faults are not the steady state
        start = time.perf_counter()
        fn()
        loops[name] = max(1, int(budget / rounds / len(fns) / max(time.perf_counter() - start, 1e-7)))
    seen = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(loops[name]):
                fn()
            seen[name].append((time.perf_counter() - start) / loops[name])
    return seen


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
