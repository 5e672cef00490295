"""The dashboard in a real browser (headless Chromium from Debian, driven by
Playwright) against a live server on the default model, with requests sent by the
openai client: the page loads with no console errors, draws one cell per block, shows
the prompt's blocks shared by n=4 samples (in the pixels of the grid, and in the
tooltip of a hovered cell) and cached-evictable once they finish (the counts equal
/metrics), and frees a stream's blocks when its client disconnects. Screenshots go to
``test-artifacts/``."""

from __future__ import annotations

import threading

import httpx
import pytest
from browser import CHROMIUM_ARGS, chromium_path, missing, screenshot
from prometheus_client.parser import text_string_to_metric_families

from pagedllm.server.launcher import ServerProcess

openai = pytest.importorskip("openai")

SERVE_ARGS = ["--kv-cache-memory", "48MiB", "--max-model-len", "1024"]
SERVE_ARGS += ["--log-stats-interval", "0"]
MODEL = "SmolLM2-135M-Instruct"
PROMPT = "A block table maps each logical block of a sequence to a physical block. " * 6


@pytest.fixture(scope="module")
def server():
    with ServerProcess(SERVE_ARGS) as process:
        yield process


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def browser():
    executable = chromium_path()
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing("playwright is not installed (pip install playwright)")
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser, server):
    """The dashboard, connected; fails the test on any console error or page error."""
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    errors = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto(f"{server.base_url}/dashboard")
    page.wait_for_function("window.pagedllmDashboard && window.pagedllmDashboard.connected")
    yield page
    page.close()
    assert errors == []


def metric(server, name: str) -> float:
    text = httpx.get(f"{server.base_url}/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise KeyError(name)


def count(page, state: str) -> int:
    return int(page.text_content(f"#count-{state}"))


CELL_PIXEL = """(id) => {
  const canvas = document.querySelector('#pool');
  const rect = canvas.getBoundingClientRect();
  const {x, y} = window.pagedllmDashboard.cellCenter(id);
  const px = Math.floor((x - rect.left) * canvas.width / rect.width);
  const py = Math.floor((y - rect.top) * canvas.height / rect.height);
  const [r, g, b] = canvas.getContext('2d').getImageData(px, py, 1, 1).data;
  return '#' + [r, g, b].map((v) => v.toString(16).padStart(2, '0')).join('');
}"""
"""The colour drawn at the centre of block ``id``'s cell, as ``#rrggbb``."""


def cells_in(page, state: str) -> list[int]:
    """Blocks whose cell the page last drew in ``state``."""
    return page.evaluate(
        """(state) => {
          const d = window.pagedllmDashboard;
          const n = Number(document.querySelector('#pool').dataset.cells);
          const ids = [];
          for (let id = 0; id < n; id++) if (d.cellState(id) === state) ids.push(id);
          return ids;
        }""",
        state,
    )


def test_the_page_draws_one_cell_per_block(page, server):
    num_blocks = metric(server, "pagedllm:kv_blocks_total")
    assert int(page.get_attribute("canvas#pool", "data-cells")) == num_blocks
    states = ("free", "held", "shared", "evictable", "window", "reserved")
    assert sum(len(cells_in(page, state)) for state in states) == num_blocks
    assert sum(count(page, state) for state in states) == num_blocks
    free = cells_in(page, "free")
    colors = page.evaluate("window.pagedllmDashboard.stateColor")
    assert page.evaluate(CELL_PIXEL, free[0]) == colors["free"]
    assert page.locator("#charts .chart").count() >= 8


def test_n4_shares_the_prompts_blocks_then_leaves_them_cached(page, server, client):
    done = threading.Event()

    def run():
        try:
            client.completions.create(
                model=MODEL, prompt=PROMPT, n=4, max_tokens=48, temperature=1.0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
        finally:
            done.set()

    threading.Thread(target=run, daemon=True).start()
    # four holders: the shade of a reference count of 4, once all four samples hold the
    # prompt's blocks (a frame drawn while the forks are made may show fewer holders)
    # (read in one evaluation: a later frame may already show a sample that finished)
    four = page.evaluate("window.pagedllmDashboard.sharedColors[4 - 2]")
    frame = page.wait_for_function(
        f"""() => {{
          const d = window.pagedllmDashboard, pixel = {CELL_PIXEL};
          const n = Number(document.querySelector('#pool').dataset.cells);
          const shared = [];
          for (let id = 0; id < n; id++) {{
            if (d.cellState(id) !== 'shared') continue;
            if (pixel(id) !== '{four}') return false;
            shared.push([id, pixel(id)]);
          }}
          return shared.length > 0 && shared;
        }}""",
        timeout=60_000,
    ).json_value()
    shared = [block_id for block_id, _ in frame]
    assert len(shared) >= len(PROMPT.split()) // 16  # the prompt's full blocks, at least
    assert {pixel for _, pixel in frame} == {four}
    center = page.evaluate("(id) => window.pagedllmDashboard.cellCenter(id)", shared[0])
    page.mouse.move(center["x"], center["y"])
    page.wait_for_selector("#tooltip", state="visible")
    tooltip = page.text_content("#tooltip")
    assert str(shared[0]) in tooltip and "cmpl-" in tooltip
    page.wait_for_selector("#requests tr.request", timeout=10_000)
    page.locator("#requests tr.request").first.click()
    page.wait_for_function(
        "document.querySelector('#block-table').textContent.trim().length > 0"
    )
    screenshot(page, "dashboard-n4-shared")
    assert done.wait(120)
    page.wait_for_function(
        "window.pagedllmDashboard.counts.used === 0 && "
        "window.pagedllmDashboard.counts.evictable > 0",
        timeout=10_000,
    )
    page.wait_for_timeout(600)  # a heartbeat later: the figures of the engine at rest
    assert count(page, "evictable") == metric(server, "pagedllm:kv_blocks_evictable") > 0
    assert count(page, "used") == metric(server, "pagedllm:kv_blocks_used") == 0
    assert int(page.text_content("#stat-evictable")) == count(page, "evictable")
    evictable = cells_in(page, "evictable")
    assert len(evictable) == count(page, "evictable")
    color = page.evaluate("window.pagedllmDashboard.stateColor.evictable")
    assert {page.evaluate(CELL_PIXEL, block_id) for block_id in evictable} == {color}
    screenshot(page, "dashboard-after-n4")


def test_a_disconnect_mid_stream_frees_its_blocks_on_the_page(page, server, client):
    stream = client.completions.create(
        model=MODEL, prompt=PROMPT + " Go on.", max_tokens=600, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = iter(stream)
    next(chunks)
    page.wait_for_selector("#requests tr.request", timeout=30_000)
    page.wait_for_function("window.pagedllmDashboard.counts.used > 0")
    screenshot(page, "dashboard-streaming")
    stream.close()  # the client goes away mid-stream
    page.wait_for_function(
        "window.pagedllmDashboard.counts.used === 0 && "
        "document.querySelectorAll('#requests tr.request').length === 0",
        timeout=30_000,
    )
    assert metric(server, "pagedllm:kv_blocks_used") == 0
    assert metric(server, "pagedllm:num_requests_aborted_total") >= 1
