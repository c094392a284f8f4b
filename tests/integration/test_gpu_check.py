"""benchmarks/gpu_check.py (issue 51): the GPU check is prepared without a GPU, so its parts are tested here -- the
dry run's one line, a failing or hanging step recorded rather than fatal, the junit and sanitizer counts, the
summary and its at most 8 files -- and the day a GPU comes, the script is not broken."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import gpu_check  # noqa: E402

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.backend.test_a" name="test_ok[cuda]" time="0.1"/>
<testcase classname="tests.backend.test_a" name="test_bad[cuda]" time="0.1"><failure message="AssertionError: 3 != 4
second line">trace</failure></testcase>
<testcase classname="tests.backend.test_b" name="test_skip[cuda]" time="0"><skipped message="no"/></testcase>
</testsuite></testsuites>"""


def test_dry_run_prints_one_line_saying_no_gpu_and_exits_0():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_check.py"), "--dry-run"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1 and "GPU" in lines[0]


def test_junit_counts_and_the_first_lines_of_each_failure(tmp_path):
    (tmp_path / "j.xml").write_text(JUNIT)
    counts = gpu_check.junit_counts(str(tmp_path / "j.xml"))
    assert (counts["passed"], counts["failed"], counts["skipped"]) == (1, 1, 1)
    # (XML turns the message's newline into a space)
    assert counts["failures"] == ["tests.backend.test_a::test_bad[cuda]: AssertionError: 3 != 4 second line"]
    assert gpu_check.junit_counts(str(tmp_path / "missing.xml"))["failures"]


def test_sanitizer_errors_sum_every_summary_line():
    text = "========= ERROR SUMMARY: 0 errors\n...\n========= ERROR SUMMARY: 3 errors\n"
    assert gpu_check.sanitizer_errors(text) == 3
    assert gpu_check.sanitizer_errors("the sanitizer never ran") is None


def test_a_failing_or_hanging_step_is_recorded_not_fatal_and_the_folder_keeps_at_most_8_files(tmp_path):
    out = tmp_path / "out"
    junit = out / "cuda-tests.xml"
    write_junit = f"import pathlib; pathlib.Path({str(junit)!r}).write_text({JUNIT!r})"
    steps = [("build", [sys.executable, "-c", "print('built')"]),
             ("tests", [sys.executable, "-c", write_junit + "; raise SystemExit(1)"]),
             ("sanitize", [sys.executable, "-c", "print('========= ERROR SUMMARY: 2 errors')"]),
             ("measure", [sys.executable, "-c", "import time; time.sleep(30)"])]
    gpu_check.LIMITS["measure"] = 2
    try:
        summary = gpu_check.check(str(out), deadline_seconds=60, steps=steps)
    finally:
        gpu_check.LIMITS["measure"] = 120
    results = {s["step"]: s["rc"] for s in summary["steps"]}
    assert results == {"build": 0, "tests": 1, "sanitize": 0, "measure": "timeout"}
    assert summary["tests"]["failed"] == 1 and summary["sanitizer_errors"] == 2
    files = sorted(os.listdir(out))
    assert len(files) <= 8 and {"summary.json", "summary.md", "cuda-tests.xml"} <= set(files)
    assert json.loads((out / "summary.json").read_text())["steps"][3]["rc"] == "timeout"
    md = (out / "summary.md").read_text()
    assert "| measure | timeout |" in md and "test_bad[cuda]: AssertionError: 3 != 4" in md


def test_the_deadline_skips_the_steps_left(tmp_path):
    summary = gpu_check.check(str(tmp_path / "out"), deadline_seconds=0, steps=[("build", ["true"])])
    assert summary["steps"] == [{"step": "build", "rc": "deadline", "ok": False, "seconds": 0, "tail": []}]


def test_the_command_on_the_gpu_machine_fits_the_device_tool():
    """docs/gpu.md's command for the device tool: under its 2,000 characters."""
    with open(os.path.join(ROOT, "docs", "gpu.md")) as f:
        text = f.read()
    command = text.split("<!-- device command -->")[1].split("```")[1].strip().removeprefix("bash").strip()
    assert 0 < len(command) <= 2000 and "make gpu-check" in command
