"""The memory timeline page (needle.memory.html): a self-contained file, and what it does in a real browser.

The pure-Python tests always run. The browser tests (marked `browser`) drive headless Chromium with chromedriver
through Selenium, loading the page from file://; they skip, saying why, where selenium, chromium or chromedriver
is missing (`make test` installs the last two where it can: the Makefile's browser-deps target).

The snapshots are synthetic (SyntheticStep below): the shape of a training step as the recorder writes it, built
without running a model, so these tests say nothing about the recorder and everything about the page.
"""
import contextlib
import json
import math
import random
import re
import shutil
import time

import pytest

from needle.toolbox.memory.html import write_html

CATEGORIES = ["parameter", "gradient", "optimizer_state", "activation_kept", "activation_recomputed", "workspace",
              "input", "other", "host"]


class SyntheticStep:
    """Builds a snapshot dict as the recorder would: allocations and frees in phases, live bytes, the peak."""

    def __init__(self, baseline_bytes=64 << 10, seed=0):
        self.rng = random.Random(seed)
        self.baseline_bytes = baseline_bytes
        self.live = baseline_bytes
        self.blocks, self.events, self.phases = [], [], []

    def phase(self, name):
        """Start phase `name` at the next event (a phase that saw no event is dropped, like the recorder's)."""
        if self.phases and self.phases[-1]["start"] == len(self.events):
            self.phases.pop()
        if self.phases and self.phases[-1]["phase"] == name:
            self.phases[-1]["end"] = None
            return
        if self.phases:
            self.phases[-1]["end"] = len(self.events)
        self.phases.append({"phase": name, "start": len(self.events), "end": None})

    def alloc(self, shape, category, op=None, module=None, reason=None, dtype="float32"):
        block = {"id": len(self.blocks), "bytes": 4 * math.prod(shape), "shape": list(shape), "dtype": dtype,
                 "category": category, "phase": self.phases[-1]["phase"], "op": op, "module": module,
                 "reason": reason, "alloc": len(self.events), "free": None}
        self.blocks.append(block)
        self.live += block["bytes"]
        self._event("alloc", block)
        return block["id"]

    def free(self, block_id):
        block = self.blocks[block_id]
        block["free"] = len(self.events)
        self.live -= block["bytes"]
        self._event("free", block)

    def _event(self, action, block):
        self.events.append({"action": action, "block": block["id"], "live_bytes": self.live,
                            "time": 1e-4 * len(self.events) + 1e-5 * self.rng.random(),
                            **{k: block[k] for k in ("bytes", "category", "phase", "op", "module", "shape", "dtype")}})

    def to_dict(self):
        self.phases[-1]["end"] = len(self.events)
        peak = max(range(len(self.events)), key=lambda i: self.events[i]["live_bytes"])
        return {"format": "needle-memory-snapshot", "version": 1, "device": "cpu()",
                "baseline_bytes": self.baseline_bytes, "blocks": self.blocks, "events": self.events,
                "peak": {"bytes": self.events[peak]["live_bytes"], "event": peak}, "phases": self.phases}


def training_step(n_layers=6, hidden=64, batch=32, seed=0, pad_to=None):
    """One step of an n-layer MLP with every other layer's activation dropped and recomputed in backward.

    Forward climbs (kept activations, dropped ones freed after their consumer ran, a workspace per layer),
    backward falls (gradients, recomputation saw-teeth), the optimizer allocates its state and frees the gradients
    oldest first (so everything above them falls). `pad_to` adds workspace alloc/free pairs until that many events.
    """
    step = SyntheticStep(seed=seed)
    rng = random.Random(seed)
    step.phase("forward")
    params = [step.alloc((hidden, hidden), "parameter", "Parameter", f"layers.{i}.weight") for i in range(n_layers)]
    x = step.alloc((batch, hidden), "input", "Tensor", None)
    kept, dropped = [], None
    for i in range(n_layers):
        work = step.alloc((batch, rng.randint(1, 4) * hidden), "workspace", "MatMul", f"layers.{i}")
        out = step.alloc((batch, hidden), "activation_kept", "ReLU" if i % 2 else "MatMul", f"layers.{i}",
                         reason="policy: keep" if i % 2 else "checkpoint boundary")
        step.free(work)
        if dropped is not None:
            step.free(dropped)
        dropped = out if i % 2 else None
        kept.append(out)
    step.phase("backward")
    grads = []
    for i in reversed(range(n_layers)):
        if i % 2:  # this layer's activation was dropped in forward: recompute it (a saw-tooth)
            step.phase("recompute")
            again = step.alloc((batch, hidden), "activation_recomputed", "ReLU", f"layers.{i}", reason="recomputed")
            step.phase("backward")
            grads.append(step.alloc((hidden, hidden), "gradient", "MatMul", f"layers.{i}.weight"))
            step.free(again)
        else:
            grads.append(step.alloc((hidden, hidden), "gradient", "MatMul", f"layers.{i}.weight"))
        if kept[i] != dropped and step.blocks[kept[i]]["free"] is None:
            step.free(kept[i])
    step.phase("optimizer")
    for i in range(n_layers):
        step.alloc((hidden, hidden), "optimizer_state", "Adam", f"layers.{i}.weight", reason="first moment")
    for g in reversed(grads):  # the oldest gradient first: everything stacked above it falls
        step.free(g)
    while pad_to is not None and len(step.events) < pad_to - 1:
        step.free(step.alloc((batch, hidden), "workspace", "Adam", "optimizer"))
    if pad_to is not None and len(step.events) < pad_to:
        step.alloc((1,), "other", None, None)
    assert params and x is not None
    return step.to_dict()


def page_payload(path):
    """The JSON the page carries, parsed back."""
    text = path.read_text(encoding="utf-8")
    found = re.search(r'<script type="application/json" id="needle-snapshots">(.*?)</script>', text, re.S)
    assert found, "no snapshot data tag in the page"
    return json.loads(found.group(1))


# ----- the file (pure Python) ----------------------------------------------------------------------------------
def test_page_is_one_self_contained_file_carrying_every_block(tmp_path):
    snapshot = training_step()
    path = write_html(snapshot, tmp_path / "out" / "timeline.html", title="one step")
    text = path.read_text(encoding="utf-8")
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", text, re.I), "the page loads something"
    assert not re.search(r"<script[^>]*\bsrc\s*=", text, re.I) and "<link rel=\"stylesheet\"" not in text
    assert "http://" not in text and "https://" not in text
    assert "__NEEDLE_" not in text, "a hole of viewer.html was left unfilled"
    assert "<title>one step</title>" in text and "path.alloc" in text  # the title and the viewer's CSS and JS
    payload = page_payload(path)
    assert payload == {"title": "one step", "snapshots": [{"label": "", "snapshot": snapshot}]}
    assert [b["id"] for b in payload["snapshots"][0]["snapshot"]["blocks"]] == list(range(len(snapshot["blocks"])))


def test_text_in_the_data_cannot_end_the_script_tag(tmp_path):
    snapshot = training_step(n_layers=2)
    snapshot["blocks"][0]["module"] = "</script><script>alert(1)</script> & <!--"
    path = write_html(snapshot, tmp_path / "t.html", title="<b>x</b> & y")
    text = path.read_text(encoding="utf-8")
    assert "alert(1)</script>" not in text and "<b>x</b>" not in text
    assert page_payload(path)["snapshots"][0]["snapshot"]["blocks"][0]["module"] == snapshot["blocks"][0]["module"]
    assert page_payload(path)["title"] == "<b>x</b> & y"


class HasToDict:
    """Stands for needle.memory's Snapshot: write_html takes anything with a to_dict()."""

    def __init__(self, snapshot):
        self.snapshot = snapshot

    def to_dict(self):
        return self.snapshot


def test_several_snapshots_keep_their_labels_in_order(tmp_path):
    off, on = training_step(n_layers=4, seed=1), training_step(n_layers=2, seed=2)
    payload = page_payload(write_html([("gc off", off), ("gc on", HasToDict(on))], tmp_path / "t.html"))
    assert [(s["label"], s["snapshot"]) for s in payload["snapshots"]] == [("gc off", off), ("gc on", on)]
    assert payload["title"] == "needle memory timeline"
    assert page_payload(write_html(HasToDict(on), tmp_path / "one.html"))["snapshots"] == [
        {"label": "", "snapshot": on}]


@pytest.mark.parametrize("break_it, error, message", [
    (lambda s: s.update(format="torch-snapshot"), ValueError, "format 'torch-snapshot'"),
    (lambda s: s.pop("phases"), ValueError, "lacks the keys ['phases']"),
    (lambda s: s["blocks"][3].pop("alloc"), ValueError, "block 3 lacks the keys ['alloc']"),
    (lambda s: s["blocks"][3].update(free=10**6), ValueError, "block 3 has alloc"),
    (lambda s: s["events"][5].update(block=999), ValueError, "event 5 (free) names block 999"),
    (lambda s: s["events"][0].update(time=float("nan")), ValueError, "NaN"),
])
def test_a_broken_snapshot_is_an_error_naming_what_is_wrong(tmp_path, break_it, error, message):
    snapshot = training_step(n_layers=2)
    break_it(snapshot)
    with pytest.raises(error, match=re.escape(message)):
        write_html(snapshot, tmp_path / "t.html")
    assert not (tmp_path / "t.html").exists()


INJECTION = "<img src=x onerror=window.__pwned=1>"


@pytest.mark.parametrize("break_it", [
    lambda s: s["peak"].update(event=INJECTION), lambda s: s["peak"].update(bytes="1 GB"),
    lambda s: s["blocks"][2].update(bytes=INJECTION), lambda s: s["phases"][0].update(start="0"),
    lambda s: s.update(baseline_bytes=None), lambda s: s["events"][1].update(live_bytes=INJECTION),
], ids=["peak event", "peak bytes", "block bytes", "phase start", "baseline", "live bytes"])
def test_a_snapshot_field_the_page_computes_with_must_be_a_number(tmp_path, break_it):
    """Issue 45: a snapshot whose peak.event was markup ran script when the page opened; write_html checks every
    number the page computes with (and the page escapes every value it shows: the browser test below)."""
    snapshot = training_step(n_layers=2)
    break_it(snapshot)
    with pytest.raises(ValueError, match="wrong"):
        write_html(snapshot, tmp_path / "t.html")
    assert not (tmp_path / "t.html").exists()


def test_a_failed_write_leaves_the_previous_page_and_snapshot_whole(tmp_path, monkeypatch):
    """Issue 45: a failed write destroyed the previous file (a 43 MB snapshot left as 100 KB): write, then rename;
    a path that is a folder is refused; a symbolic link's target is replaced, the link kept."""
    from needle.toolbox.memory import Snapshot
    snapshot = training_step(n_layers=2)
    page, saved = write_html(snapshot, tmp_path / "t.html"), Snapshot(snapshot).save(tmp_path / "s.json")
    before = (page.read_bytes(), saved.read_bytes())
    failing = training_step(n_layers=4)
    monkeypatch.setattr(json, "dumps", lambda *a, **k: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):
        Snapshot(failing).save(tmp_path / "s.json")
    with pytest.raises(OSError, match="disk full"):
        write_html(failing, tmp_path / "t.html")
    monkeypatch.undo()
    assert (page.read_bytes(), saved.read_bytes()) == before and sorted(p.name for p in tmp_path.iterdir()) == [
        "s.json", "t.html"]
    with pytest.raises(ValueError, match="exists and is not a regular file"):
        write_html(snapshot, tmp_path)
    (tmp_path / "link.html").symlink_to(page)
    write_html(failing, tmp_path / "link.html")
    assert (tmp_path / "link.html").is_symlink() and page.read_bytes() != before[0]


def test_snapshots_that_are_not_label_snapshot_pairs_are_a_type_error(tmp_path):
    with pytest.raises(TypeError, match=r"snapshots\[0\] is str"):
        write_html(["gc off"], tmp_path / "t.html")
    with pytest.raises(ValueError, match="no snapshots"):
        write_html([], tmp_path / "t.html")


# ----- the page in headless Chromium ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def driver():
    """One headless Chromium for this module's browser tests, or a skip saying what is missing."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip("selenium is not installed (pip install selenium, or the test extra)")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    chromedriver = shutil.which("chromedriver")
    missing = [name for name, found in (("chromium", chromium), ("chromedriver", chromedriver)) if not found]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not found on PATH (make browser-deps, or "
                    "apt-get install chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     "--window-size=1400,1000"):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    chrome = webdriver.Chrome(service=Service(chromedriver), options=options)
    yield chrome
    chrome.quit()


def open_page(driver, path):
    """Load the page from file:// and return its render time (ms); fail on any console error while loading."""
    driver.get(path.resolve().as_uri())
    render_ms, waited = None, time.monotonic()
    while render_ms is None and time.monotonic() - waited < 10:  # (a loaded machine may hand the page back early)
        render_ms = driver.execute_script("return document.body.dataset.renderMs")
        time.sleep(0.05 if render_ms is None else 0)
    assert render_ms is not None, f"the viewer's script did not finish its first draw: {driver.get_log('browser')}"
    assert_no_console_errors(driver)
    return float(render_ms)


def assert_no_console_errors(driver):
    errors = [entry["message"] for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]
    assert errors == [], f"console errors: {errors}"


def drawn_blocks(driver, panel=0):
    return driver.execute_script(
        "return [...document.querySelectorAll('.panel')[arguments[0]].querySelectorAll('path.alloc')]"
        ".map(p => Number(p.dataset.block))", panel)


# The middle of a block halfway through its life, in CSS pixels from the centre of its panel's <svg> (where
# Selenium's offsets start), read from the viewer's own plan and scales.
POINT_INSIDE_BLOCK = """
const panel = window.needleMemoryPanels[0], g = panel.geometry, block = panel.byId.get(String(arguments[0]));
const t = Math.floor((block.alloc + (block.free === null ? g.xs.length - 1 : block.free)) / 2);
let offset = block.steps[1];
for (let k = 0; k < block.steps.length; k += 2) if (block.steps[k] <= t) offset = block.steps[k + 1];
const box = panel.svg.getBoundingClientRect(), scale = box.width / g.width;
return [g.X((g.xs[t] + g.xs[t + 1]) / 2) * scale - box.width / 2,
        g.Y(offset + block.bytes / 2) * scale - box.height / 2];
"""


def alive_at(snapshot, t):
    alive = [b for b in snapshot["blocks"] if (b["alloc"] is None or b["alloc"] <= t)
             and (b["free"] is None or t < b["free"])]
    return sorted(alive, key=lambda b: -b["bytes"])


@pytest.mark.browser
def test_page_loads_from_file_without_errors_and_draws_one_shape_per_allocation(driver, tmp_path):
    from selenium.webdriver.common.by import By

    snapshot = training_step()
    open_page(driver, write_html(snapshot, tmp_path / "t.html"))
    assert sorted(drawn_blocks(driver)) == [b["id"] for b in snapshot["blocks"]]
    assert all(driver.execute_script("return [...document.querySelectorAll('path.alloc')].map(p => "
                                     "p.getAttribute('d').length > 0)"))
    legend = driver.find_element(By.ID, "legend").text
    assert all(category in legend for category in CATEGORIES)
    phases = driver.execute_script("return [...document.querySelectorAll('.phase-band')].map(g => g.dataset.phase)")
    assert phases == [p["phase"] for p in snapshot["phases"]]
    peak = driver.find_element(By.CSS_SELECTOR, ".peak text").text
    assert peak == f"peak {snapshot['peak']['bytes'] / 2**20:.2f} MiB (event {snapshot['peak']['event']})"
    assert "live memory (MiB)" in driver.find_element(By.TAG_NAME, "svg").text


@pytest.mark.browser
def test_markup_in_a_snapshot_is_shown_as_text_never_run(driver, tmp_path):
    """Issue 45: the page put peak.event into innerHTML unescaped. Here a page whose data was edited after it was
    written (past write_html's checks) carries markup in the peak, a label, an op and a category: opening it,
    hovering and clicking run no script and add no element."""
    snapshot = training_step(n_layers=2)
    snapshot["blocks"][0].update(op=INJECTION, category=INJECTION)
    path = write_html([(INJECTION, snapshot)], tmp_path / "t.html")
    text = path.read_text(encoding="utf-8")
    payload = page_payload(path)
    payload["snapshots"][0]["snapshot"]["peak"]["event"] = INJECTION
    edited = json.dumps(payload).replace("<", "\\u003c").replace(">", "\\u003e")
    path.write_text(re.sub(r'(id="needle-snapshots">).*?(</script>)', lambda m: m.group(1) + edited + m.group(2),
                           text, flags=re.S), encoding="utf-8")
    driver.get(path.resolve().as_uri())
    driver.execute_script("document.querySelectorAll('path.alloc').forEach(p => p.dispatchEvent(new MouseEvent("
                          "'mouseover', {bubbles: true, clientX: 5, clientY: 5})))")
    assert driver.execute_script("return window.__pwned === undefined && document.querySelectorAll('img').length "
                                 "=== 0")
    assert INJECTION in driver.execute_script("return document.body.textContent")
    assert_no_console_errors(driver)


@pytest.mark.browser
def test_the_stack_is_exact_its_top_is_the_recorded_live_bytes(driver, tmp_path):
    snapshot = training_step()
    open_page(driver, write_html(snapshot, tmp_path / "t.html"))
    # The viewer's plan: each block's lower edge (bytes) from each event on. At every event, the highest top edge
    # of the blocks alive then is the live bytes the recorder wrote.
    steps = driver.execute_script("return window.needleMemoryPanels[0].blocks.map(b => [b.id, b.steps])")
    edges = {block_id: list(zip(s[::2], s[1::2])) for block_id, s in steps}
    for t, event in enumerate(snapshot["events"]):
        tops = [[off for e, off in edges[b["id"]] if e <= t][-1] + b["bytes"] for b in alive_at(snapshot, t)]
        assert max(tops, default=snapshot["baseline_bytes"]) == event["live_bytes"], f"event {t}"


@pytest.mark.browser
def test_hovering_an_allocation_shows_its_op_shape_and_reason(driver, tmp_path):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    snapshot = training_step()
    open_page(driver, write_html(snapshot, tmp_path / "t.html"))
    tooltip = driver.find_element(By.ID, "tooltip")
    assert not tooltip.is_displayed()
    svg = driver.find_element(By.CSS_SELECTOR, ".panel svg")
    # A parameter (alive the whole step) and a kept activation that falls when the dropped one below it is freed.
    kept = next(b for b in snapshot["blocks"] if b["reason"] == "checkpoint boundary" and b["module"] == "layers.4")
    for block in (snapshot["blocks"][1], kept):
        dx, dy = driver.execute_script(POINT_INSIDE_BLOCK, block["id"])
        ActionChains(driver).move_to_element_with_offset(svg, round(dx), round(dy)).perform()
        assert tooltip.is_displayed()
        text = tooltip.text
        assert f"block {block['id']}" in text
        for needle_text in (block["op"], block["module"], "(" + ", ".join(map(str, block["shape"])) + ")",
                            block["dtype"], block["category"], block["phase"], f"{block['bytes']:,} B"):
            assert needle_text in text
        assert (block["reason"] or "—") in text
    assert_no_console_errors(driver)


@pytest.mark.browser
def test_clicking_an_instant_lists_every_block_alive_largest_first(driver, tmp_path):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    snapshot = training_step()
    open_page(driver, write_html(snapshot, tmp_path / "t.html"))
    svg = driver.find_element(By.CSS_SELECTOR, ".panel svg")
    for fraction in (0.25, 0.55, 0.8):  # in forward, in backward, in the optimizer
        width = svg.size["width"]
        ActionChains(driver).move_to_element_with_offset(svg, int(width * (fraction - 0.5)), 0).click().perform()
        alive_panel = driver.find_element(By.ID, "alive")
        t = int(re.match(r"Alive at event (\d+)", alive_panel.find_element(By.TAG_NAME, "h2").text).group(1))
        listed = [int(row.get_attribute("data-block"))
                  for row in alive_panel.find_elements(By.CSS_SELECTOR, "tr[data-block]")]
        expected = alive_at(snapshot, t)
        assert sorted(listed) == sorted(b["id"] for b in expected), f"event {t}"
        assert [snapshot["blocks"][i]["bytes"] for i in listed] == [b["bytes"] for b in expected]  # largest first
        assert len(driver.find_elements(By.CSS_SELECTOR, "line.instant")) == 1
    assert_no_console_errors(driver)


@pytest.mark.browser
def test_drag_and_wheel_zoom_in_and_reset_zooms_out(driver, tmp_path):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.actions.wheel_input import ScrollOrigin
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    snapshot = training_step()
    n = len(snapshot["events"])
    open_page(driver, write_html(snapshot, tmp_path / "t.html"))
    view = "return window.needleMemoryPanels[0].view"
    assert driver.execute_script(view) == {"x0": 0, "x1": n}
    svg = driver.find_element(By.CSS_SELECTOR, ".panel svg")
    ActionChains(driver).move_to_element_with_offset(svg, -100, 0).click_and_hold() \
        .move_by_offset(200, 0).release().perform()
    dragged = driver.execute_script(view)
    assert 0 < dragged["x0"] < dragged["x1"] < n and dragged["x1"] - dragged["x0"] < n / 2
    assert sorted(drawn_blocks(driver)) == [b["id"] for b in snapshot["blocks"]]  # still one path per allocation
    driver.find_element(By.ID, "reset").click()
    assert driver.execute_script(view) == {"x0": 0, "x1": n}
    ActionChains(driver).scroll_from_origin(ScrollOrigin.from_element(svg), 0, -300).perform()
    wheeled = driver.execute_script(view)
    assert 0 <= wheeled["x0"] < wheeled["x1"] <= n and wheeled["x1"] - wheeled["x0"] < n
    Select(driver.find_element(By.ID, "xmode")).select_by_value("time")  # x = time: the full step again
    timed = driver.execute_script(view)
    assert timed["x0"] == snapshot["events"][0]["time"] and timed["x1"] > snapshot["events"][-1]["time"]
    assert sorted(drawn_blocks(driver)) == [b["id"] for b in snapshot["blocks"]]
    assert_no_console_errors(driver)


@pytest.mark.browser
def test_snapshots_side_by_side_share_one_y_axis(driver, tmp_path):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    big, small = training_step(n_layers=8, hidden=96, seed=1), training_step(n_layers=4, seed=2)
    open_page(driver, write_html([("gc off", big), ("gc on", small)], tmp_path / "t.html"))
    assert driver.execute_script("return [...document.querySelectorAll('.panel h2')].map(h => h.textContent)") \
        == ["gc off", "gc on"]
    assert sorted(drawn_blocks(driver, 0)) == [b["id"] for b in big["blocks"]]
    assert sorted(drawn_blocks(driver, 1)) == [b["id"] for b in small["blocks"]]
    peak_y = driver.execute_script(
        "return [...document.querySelectorAll('.peak circle')].map(c => Number(c.getAttribute('cy')))")
    tick_labels = driver.execute_script(
        "return [...document.querySelectorAll('.panel')].map(p => [...p.querySelectorAll('.axis text')]"
        ".map(t => t.textContent).join('|'))")
    assert peak_y[0] < peak_y[1], "the smaller peak must stand lower on the shared axis"
    assert tick_labels[0].split("|")[:5] == tick_labels[1].split("|")[:5]  # the same y ticks in both panels
    for panel, label in ((0, "gc off"), (1, "gc on")):  # the alive list follows the last panel clicked
        svg = driver.find_elements(By.CSS_SELECTOR, ".panel svg")[panel]
        ActionChains(driver).move_to_element(svg).click().perform()
        assert f" of {label}: " in driver.find_element(By.CSS_SELECTOR, "#alive h2").text
        assert len(driver.find_elements(By.CSS_SELECTOR, "line.instant")) == 1
    assert_no_console_errors(driver)


@pytest.mark.browser
def test_an_empty_snapshot_draws_its_axes_and_says_so(driver, tmp_path):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.actions.wheel_input import ScrollOrigin
    from selenium.webdriver.common.by import By

    empty = {"format": "needle-memory-snapshot", "version": 1, "device": "cpu()", "baseline_bytes": 1 << 20,
             "blocks": [], "events": [], "peak": {"bytes": 1 << 20, "event": None}, "phases": []}
    open_page(driver, write_html(empty, tmp_path / "t.html"))
    assert "no events recorded" in driver.execute_script("return document.querySelector('svg').textContent")
    assert drawn_blocks(driver) == []
    svg = driver.find_element(By.CSS_SELECTOR, ".panel svg")
    ActionChains(driver).scroll_from_origin(ScrollOrigin.from_element(svg), 0, -300).click(svg).perform()
    assert driver.execute_script("return window.needleMemoryPanels[0].view") == {"x0": 0, "x1": 1}
    assert_no_console_errors(driver)


@pytest.mark.browser
def test_a_5000_event_step_renders_in_under_a_second(driver, tmp_path):
    snapshot = training_step(n_layers=400, pad_to=5000)
    assert len(snapshot["events"]) == 5000
    render_ms = open_page(driver, write_html(snapshot, tmp_path / "t.html"))
    print(f"\n5,000-event snapshot ({len(snapshot['blocks'])} blocks): first draw in {render_ms:.0f} ms")
    assert len(drawn_blocks(driver)) == len(snapshot["blocks"])
    assert render_ms < 1000


def recorded_training_step():
    """A real snapshot: one step of a small LM with gc "all", recorded after a first, unrecorded step (so blocks
    alive before recording began are in it, and some of them are freed while it records)."""
    import numpy as np

    import needle as ndl
    from models import LanguageModel

    device = ndl.cpu()
    if not device.enabled():
        pytest.skip("the compiled CPU backend is not built")
    np.random.seed(0)
    model = LanguageModel(16, 40, 32, num_layers=2, seq_model="transformer", seq_len=8, device=device, num_head=2,
                          dim_head=8).enable_gc()
    opt = ndl.optim.Adam(model.parameters(), lr=0.01)
    X = ndl.Tensor(np.random.randint(0, 40, (8, 4)), device=device, requires_grad=False)
    y = ndl.Tensor(np.random.randint(0, 40, (32,)), device=device, requires_grad=False)
    for recorded in (False, True):
        with ndl.memory.record(device) if recorded else contextlib.nullcontext() as snap:
            opt.reset_grad()
            ndl.nn.SoftmaxLoss()(model(X)[0], y).backward()
            opt.step()
    return snap


@pytest.mark.browser
def test_a_recorded_step_draws_every_block_and_its_exact_stack(driver, tmp_path):
    snap = recorded_training_step()
    snapshot = snap.to_dict()
    assert any(b["alloc"] is None for b in snapshot["blocks"]) and any(b["category"] == "activation_recomputed"
                                                                      for b in snapshot["blocks"])
    open_page(driver, snap.to_html(tmp_path / "step.html"))
    assert sorted(drawn_blocks(driver)) == [b["id"] for b in snapshot["blocks"]]
    steps = driver.execute_script("return window.needleMemoryPanels[0].blocks.map(b => [b.id, b.steps])")
    edges = {block_id: list(zip(s[::2], s[1::2])) for block_id, s in steps}
    for t, event in enumerate(snapshot["events"]):
        tops = [[off for e, off in edges[b["id"]] if e <= t][-1] + b["bytes"] for b in alive_at(snapshot, t)]
        assert max(tops, default=snapshot["baseline_bytes"]) == event["live_bytes"], f"event {t}"
