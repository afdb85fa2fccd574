"""The generated benchmark tables are up to date with benchmarks/results/, and the docs' relative
links point at files that exist (the strict MkDocs build, `make docs`, checks anchors too)."""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_generated_benchmark_tables_are_up_to_date():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "report.py"), "--check"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr + out.stdout


def test_readme_links_point_at_existing_files():
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    missing = [t for t in targets if not t.startswith("http") and not os.path.exists(os.path.join(ROOT, t))]
    assert targets and not missing, missing


def test_report_check_fails_on_a_stale_table(tmp_path, monkeypatch):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import report
    finally:
        sys.path.pop(0)
    readme = tmp_path / "README.md"
    with open(os.path.join(ROOT, "README.md")) as f:
        readme.write_text(f.read().replace("| DDP + fused AdamW |", "| DDP + fused AdamW (edited) |"))
    (tmp_path / "docs").mkdir()
    with open(os.path.join(ROOT, "docs", "benchmarks.md")) as f:
        (tmp_path / "docs" / "benchmarks.md").write_text(f.read())
    monkeypatch.setattr(report, "ROOT", str(tmp_path))
    assert report.main(["--check"]) == 1
    assert report.main([]) == 0 and report.main(["--check"]) == 0
    with open(os.path.join(ROOT, "README.md")) as f:
        assert readme.read_text() == f.read()


def test_readme_opens_with_the_two_commands_and_stays_short():
    with open(os.path.join(ROOT, "README.md")) as f:
        lines = f.read().splitlines()
    block = lines[lines.index("```bash") + 1: lines.index("```")]
    assert [line.split()[:2] for line in block] == [["make", "demo"], ["make", "test"]], block
    assert lines.index("```bash") < 5
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; keep it to 150 and move details into docs/"
