"""transformers.js itself, as a client of the lab's model folders: in Node (onnxruntime-node) and in headless
Chromium (the browser build, onnxruntime-web's WASM), each giving greedy tokens and the memory it measured.

`@huggingface/transformers` is pinned in tests/transformersjs/package-lock.json and installed once, with
`npm ci --ignore-scripts` (onnxruntime-node ships its CPU binary in the package; its install script would fetch a
GPU build from a host the tests cannot reach), into ${ONNX_LAB_CACHE:-~/.cache/embedding-onnx-lab}/transformersjs/
under the lock file's digest; the drivers (greedy_node.mjs, greedy.html) are copied beside it on each use. Nothing
is fetched at test time but that one install: the browser page, transformers.js's web build, onnxruntime-web's WASM
files and the model folder are served from this machine by the test's own http server.

    ./lab_env/python -m tests.transformersjs_client FOLDER [PROMPTS [NEW]]   # both clients' tokens and memory
"""
import contextlib
import functools
import hashlib
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

from tests.fixtures.smollm2 import cache
from tests.helpers import ROOT

SOURCE = os.path.join(ROOT, "tests", "transformersjs")
DRIVERS = ("greedy_node.mjs", "greedy.html")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--enable-precise-memory-info"]


def node():
    return shutil.which("node")


def chromium():
    return shutil.which("chromium") or shutil.which("chromium-browser")


@functools.lru_cache(maxsize=None)
def installed():
    """The folder holding node_modules/@huggingface/transformers (npm ci'd from the lock, once per lock) and the
    drivers. Made in a staging folder and renamed into place: a run that dies leaves nothing half made."""
    with open(os.path.join(SOURCE, "package-lock.json"), "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:16]
    base = os.path.join(cache(), "transformersjs")
    where = os.path.join(base, digest)
    if not os.path.isdir(os.path.join(where, "node_modules", "@huggingface", "transformers")):
        os.makedirs(base, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=f".installing-{os.getpid()}-", dir=base)
        try:
            for name in ("package.json", "package-lock.json"):
                shutil.copy(os.path.join(SOURCE, name), staging)
            done = subprocess.run(["npm", "ci", "--ignore-scripts", "--no-audit", "--no-fund", "--loglevel=error"],
                                  cwd=staging, capture_output=True, text=True, timeout=900)
            if done.returncode:
                raise RuntimeError(f"npm ci --ignore-scripts in {staging} failed: {done.stderr.strip()[-2000:]}")
            try:
                os.rename(staging, where)
            except OSError:  # another run placed it first
                if not os.path.isdir(where):
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    for name in DRIVERS:  # the drivers are the repository's, whatever an earlier run copied
        with open(os.path.join(SOURCE, name), "rb") as f:
            data = f.read()
        target = os.path.join(where, name)
        if not os.path.exists(target) or open(target, "rb").read() != data:
            fd, staged = tempfile.mkstemp(dir=where)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(staged, target)
    return where


def prompts_text(prompts):
    return ";".join(",".join(str(i) for i in ids) for ids in prompts)


def node_greedy(folder, prompts, new, dtype="fp32", timeout=300):
    """{"tokens": [[new ids] per prompt], "rss_start", "rss_loaded", "rss"}: AutoModelForCausalLM.generate (greedy)
    on the local folder in a fresh Node process; RSS in bytes from process.memoryUsage(), "rss" after the last
    generate. RuntimeError with transformers.js's own message when it cannot load or run the folder."""
    done = subprocess.run([node(), os.path.join(installed(), "greedy_node.mjs"), os.path.abspath(folder),
                           prompts_text(prompts), str(new), dtype], capture_output=True, text=True, timeout=timeout)
    if done.returncode:
        raise RuntimeError(f"transformers.js (Node) on {folder}: {done.stderr.strip()[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


class _Handler(http.server.SimpleHTTPRequestHandler):
    """Serves /tjs/ (transformers.js's dist), /ort/ (onnxruntime-web's dist), /models/NAME/ (the model folder) and
    the page; nothing else. No caching, so each page load reads the files as they are."""
    extensions_map = {**http.server.SimpleHTTPRequestHandler.extensions_map, ".mjs": "text/javascript",
                      ".js": "text/javascript", ".wasm": "application/wasm", ".json": "application/json"}
    routes = {}

    def translate_path(self, path):
        path = path.split("?", 1)[0].split("#", 1)[0]
        for prefix, folder in self.routes.items():
            if path.startswith(prefix):
                rest = os.path.normpath("/" + path[len(prefix):]).lstrip("/")  # no `..` out of the folder
                return os.path.join(folder, rest)
        return os.path.join(self.routes["/"], "missing")

    def end_headers(self):
        self.send_header("Cache-Control", "no-store")
        super().end_headers()

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def serving(folder):
    """(base url, model name) of a local http server for the page, transformers.js's web build, onnxruntime-web's
    WASM files and `folder` as /models/NAME/; stopped on exit."""
    where = installed()
    name = os.path.basename(os.path.abspath(folder))
    routes = {"/tjs/": os.path.join(where, "node_modules", "@huggingface", "transformers", "dist"),
              "/ort/": os.path.join(where, "node_modules", "onnxruntime-web", "dist"),
              f"/models/{name}/": os.path.abspath(folder), "/": where}
    handler = type("Handler", (_Handler,), {"routes": routes})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", name
    finally:
        server.shutdown()
        server.server_close()


def _renderers(pid):
    """RSS bytes of each Chromium renderer process under `pid` (this process's descendants), read from /proc."""
    children, rss = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                renderer = b"--type=renderer" in f.read()
            with open(f"/proc/{entry}/status") as f:
                found = re.search(r"^VmRSS:\s+(\d+) kB", f.read(), re.M)
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry))
        if renderer and found:
            rss[int(entry)] = int(found.group(1)) * 1024
    below, stack = set(), [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            below.add(child)
            stack.append(child)
    return [rss[p] for p in below if p in rss]


def browser_greedy(folder, prompts, new, dtype="fp32", timeout=300):
    """{"tokens": [[new ids] per prompt], "js_heap_used", "js_heap_total", "used_js_heap", "renderer_rss"}:
    transformers.js's browser build (onnxruntime-web, WASM) in headless Chromium on the local folder, served by
    serving(). js_heap_*: CDP Performance.getMetrics' JSHeapUsedSize / JSHeapTotalSize after the last generate;
    used_js_heap: the page's performance.memory.usedJSHeapSize (precise memory info on); renderer_rss: the largest
    renderer process's VmRSS. RuntimeError with the page's error when transformers.js fails."""
    from playwright.sync_api import sync_playwright
    with serving(folder) as (base, name), sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium(), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            console = []
            page.on("console", lambda message: console.append(message.text))
            cdp = page.context.new_cdp_session(page)
            cdp.send("Performance.enable")
            page.goto(f"{base}/greedy.html?model={name}&prompts={prompts_text(prompts)}&new={new}&dtype={dtype}")
            page.wait_for_function("window.result !== undefined || window.error !== undefined",
                                   timeout=timeout * 1000)
            error = page.evaluate("window.error")
            if error is not None:
                raise RuntimeError(f"transformers.js (browser) on {folder}: {error}" +
                                   "".join(f"\n  console: {line}" for line in console[-5:]))
            result = page.evaluate("window.result")
            page.evaluate("new Promise(r => setTimeout(r, 100))")
            metrics = {m["name"]: m["value"] for m in cdp.send("Performance.getMetrics")["metrics"]}
            result.update(js_heap_used=int(metrics["JSHeapUsedSize"]), js_heap_total=int(metrics["JSHeapTotalSize"]),
                          renderer_rss=max(_renderers(os.getpid()), default=None))
            return result
        finally:
            browser.close()


def main(argv=None):
    args = sys.argv[1:] if argv is None else argv
    folder = args[0]
    prompts = [[int(t) for t in p.split(",")] for p in (args[1] if len(args) > 1 else "1,2,3,4").split(";")]
    new = int(args[2]) if len(args) > 2 else 8
    for client, run in (("node", node_greedy), ("browser", browser_greedy)):
        started = time.perf_counter()
        print(client, json.dumps(run(folder, prompts, new)), f"{time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
