"""Open ONNX models in Netron, served by the `netron` package and shown in headless Chromium.

    python -m tests.netron_view MODELS_DIR OUT_DIR    # one PNG per model (how docs/ was made)

Netron refuses window.eval, so everything goes through Playwright locators.
"""
import os
import shutil
import sys

import netron
from playwright.sync_api import sync_playwright

# Flags for a root, offline, headless Chromium: no sandbox, no GPU, no background traffic to refuse.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-sync",
                 "--disable-background-networking", "--disable-component-update"]


def chromium():
    return shutil.which("chromium") or shutil.which("chromium-browser")


def render(paths, screenshots=None, labels=("Gather",)):
    """For each model: {label: how many rendered nodes show it}; screenshots go to `screenshots[i]` if given."""
    counts = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium(), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1100, "height": 1300})
            for i, path in enumerate(paths):
                host, port = netron.serve(os.fspath(path), address=("localhost", 0), browse=False)
                try:
                    page.goto(f"http://{host}:{port}")
                    accept = page.get_by_role("button", name="Accept")  # the cookie prompt, first visit only
                    page.locator("g.node").or_(accept).first.wait_for(timeout=30_000)
                    if accept.is_visible():
                        accept.click()
                    page.locator("g.node").first.wait_for(timeout=30_000)
                    counts.append({label: page.locator("g.node", has_text=label).count() for label in labels})
                    if screenshots:
                        page.locator("svg#canvas").screenshot(path=os.fspath(screenshots[i]))
                finally:
                    netron.stop(address=(host, port))
        finally:
            browser.close()
    return counts


def main(argv=None):
    models, out = (sys.argv[1:] if argv is None else argv)
    names = sorted(n for n in os.listdir(models) if n.endswith(".onnx"))
    os.makedirs(out, exist_ok=True)
    render([os.path.join(models, n) for n in names], [os.path.join(out, n[:-5] + ".png") for n in names])
    for name in names:
        print(os.path.join(out, name[:-5] + ".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
