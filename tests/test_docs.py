"""The documents: README.md (the front door), docs/*.md, BENCHMARKS.md and its pages under docs/benchmarks/.

Every relative link resolves (file and heading anchor, by GitHub's slug rules), and so does every reference to a
benchmark page's heading anywhere in the repository (``BENCHMARKS.md#anchor``, ``docs/benchmarks/vision.md,
"Section"`` in a docstring); no document states a test count; the README keeps the commands CI and users run; the
pages name public import paths only; BENCHMARKS.md stays a front page; and ``benchmarks/make_benchmarks.py render``
reproduces every benchmark page byte for byte, keeping its hand-written parts.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH_PAGES = sorted((REPO / "docs" / "benchmarks").glob("*.md"))
DOCS = sorted([*REPO.glob("*.md"), *(REPO / "docs").glob("*.md"), *BENCH_PAGES])
PAGES = sorted((REPO / "docs").glob("*.md"))


# --------------------------------------------------------------------------- links and anchors

FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")


def _prose_lines(text: str):
    """(line number, line) outside fenced code blocks, with inline code spans blanked out."""
    fenced = False
    for i, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield i, INLINE_CODE.sub(lambda m: " " * len(m.group(0)), line)


def github_anchors(text: str) -> set[str]:
    """The anchors GitHub gives the headings of ``text``: the heading's text (formatting and links reduced to their
    text) in lower case, every character that is not a letter, digit, '_', '-' or space removed, spaces turned into
    '-'; a repeated anchor gets '-1', '-2', ... in order."""
    anchors: set[str] = set()
    counts: dict[str, int] = {}
    fenced = False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        m = None if fenced else re.match(r"^ {0,3}#{1,6}[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$", line)
        if not m:
            continue
        title = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1))  # a link counts as its text
        title = re.sub(r"<[^>]+>", "", title).replace("\\", "")
        chars = [c for c in title.strip().lower() if c.isalnum() or c in "_- "]
        base = "".join(chars).replace(" ", "-")
        n = counts.get(base, 0)
        counts[base] = n + 1
        anchors.add(base if n == 0 else f"{base}-{n}")
    return anchors


def broken_links(page: Path, root: Path = REPO) -> list[str]:
    """Every relative link of ``page`` whose file does not exist or whose ``#anchor`` is no heading of its target."""
    text = page.read_text()
    bad = []
    for lineno, line in _prose_lines(text):
        for m in LINK.finditer(line):
            target = m.group(1)
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:, ...
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(root)}:{lineno}: {target}"
            if not dest.exists():
                bad.append(f"{where}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in github_anchors(dest.read_text()):
                bad.append(f"{where}: no heading with this anchor in {dest.relative_to(root)}")
    return bad


def test_the_documents_exist():
    names = {p.relative_to(REPO).as_posix() for p in DOCS}
    for name in ("README.md", "BENCHMARKS.md", "docs/methods.md", "docs/cli.md", "docs/claims.md", "docs/extending.md"):
        assert name in names
    assert {p.stem for p in BENCH_PAGES} >= {"cpu", "vision", "anchor", "claims", "contention", "gpu", "compile"}


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_relative_link_resolves(page):
    assert broken_links(page) == []


def test_the_link_checker_finds_broken_links(tmp_path):
    (tmp_path / "other.md").write_text("# Other\n\n## Some heading: `code`, and more!\n\n## Twice\n\n## Twice\n")
    page = tmp_path / "page.md"
    good = ("[a](other.md) [b](other.md#some-heading-code-and-more) [c](other.md#twice-1) [d](#local--heading) "
            "[e](https://example.com/x#y) `[f](missing.md)`\n\n```\n[g](missing.md)\n```\n")
    page.write_text("# Page\n\n## Local — heading\n\n" + good)
    assert broken_links(page, tmp_path) == []
    page.write_text("# Page\n\n## Local — heading\n\n" + good + "[h](missing.md) [i](other.md#twice-2) [j](#nowhere)\n")
    bad = broken_links(page, tmp_path)
    assert len(bad) == 3 and "missing.md: no such file" in bad[0]
    assert "other.md#twice-2: no heading" in bad[1] and "#nowhere: no heading" in bad[2]


def test_github_anchor_rules():
    text = ("# attnpatch\n## `tune`: the cheapest setting that meets a target\n## FNA's break-even (`min_tokens=auto`)\n"
            "## AnchorFormer against Nyström: per-layer errors\n## Device: cpu\n## Device: cpu\n"
            "```\n## not a heading\n```\n### anchor_attention under the competitor\n")
    assert github_anchors(text) == {
        "attnpatch", "tune-the-cheapest-setting-that-meets-a-target", "fnas-break-even-min_tokensauto",
        "anchorformer-against-nyström-per-layer-errors", "device-cpu", "device-cpu-1",
        "anchor_attention-under-the-competitor"}


#: A benchmark page as the repository names it: the front page, or a page under docs/benchmarks/ (from docs/*.md:
#: ``benchmarks/NAME.md``; from a docstring: ``docs/benchmarks/NAME.md``).
BENCH_PAGE = r"(?P<page>BENCHMARKS\.md|(?:docs/)?benchmarks/[\w-]+\.md)"
#: ``PAGE#anchor``: a link or a plain reference to a heading of a benchmark page.
BENCH_ANCHOR = re.compile(BENCH_PAGE + r"#(?P<anchor>[^\s)\]\"'`,;]+)")
#: ``PAGE, "Section"`` / ``PAGE ("Section")`` (also ``[PAGE, "Section"](...)``): a heading named by its text, or the
#: start of it.
BENCH_SECTION = re.compile(BENCH_PAGE + r"(?:\]?,\s*|\s+\()\"(?P<name>[^\"]+)\"")
#: The files that refer to the benchmark pages: documents, the package's docstrings, the scripts and the tests.
REFERRERS = ("*.md", "docs/**/*.md", "attnpatch/**/*.py", "benchmarks/*.py", "tests/*.py")


def _bench_page(name: str, root: Path) -> Path:
    return root / ("BENCHMARKS.md" if name == "BENCHMARKS.md" else f"docs/benchmarks/{Path(name).name}")


def _heading_texts(text: str) -> list[str]:
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced and (m := re.match(r"^ {0,3}#{1,6}[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$", line)):
            out += [m.group(1), m.group(1).replace("`", "")]
    return out


def broken_bench_references(root: Path = REPO, skip: tuple[str, ...] = ("tests/test_docs.py",)) -> tuple[list[str], int]:
    """Every reference to a benchmark page's heading under ``root`` (``BENCHMARKS.md#anchor``,
    ``docs/benchmarks/x.md#anchor``, ``BENCHMARKS.md, "Section"``, ``docs/benchmarks/x.md ("Section")``) whose page
    does not exist or has no such heading (an anchor by GitHub's rules; a section name: the start of a heading's
    text), and the number of references checked."""
    bad, checked = [], 0
    files = sorted({f for pattern in REFERRERS for f in root.glob(pattern) if f.is_file()})
    for f in files:
        rel = f.relative_to(root).as_posix()
        if rel in skip:
            continue
        text = re.sub(r"\s+", " ", f.read_text())  # a section name may run over a line break of a docstring
        for m in BENCH_ANCHOR.finditer(text):
            checked += 1
            page = _bench_page(m["page"], root)
            if not page.is_file():
                bad.append(f"{rel}: {m.group(0)}: no such page")
            elif m["anchor"] not in github_anchors(page.read_text()):
                bad.append(f"{rel}: {m.group(0)}: no heading with this anchor in {page.relative_to(root).as_posix()}")
        for m in BENCH_SECTION.finditer(text):
            checked += 1
            page = _bench_page(m["page"], root)
            if not page.is_file():
                bad.append(f"{rel}: {m.group(0)}: no such page")
            elif not any(h.startswith(m["name"]) for h in _heading_texts(page.read_text())):
                bad.append(f"{rel}: {m.group(0)}: no heading starting so in {page.relative_to(root).as_posix()}")
    return bad, checked


def test_every_reference_to_a_benchmark_heading_resolves():
    bad, checked = broken_bench_references()
    assert bad == []
    assert checked >= 20, "the references to the benchmark pages were not found: is the pattern still right?"


def test_the_reference_checker_finds_broken_references(tmp_path):
    (tmp_path / "docs" / "benchmarks").mkdir(parents=True)
    (tmp_path / "attnpatch").mkdir()
    (tmp_path / "BENCHMARKS.md").write_text("# Benchmarks\n\n## Summary\n")
    (tmp_path / "docs" / "benchmarks" / "vision.md").write_text("# Vision\n\n## FNA presets: speed (2026-12-01)\n")
    (tmp_path / "docs" / "cli.md").write_text(
        '[a](../BENCHMARKS.md#summary) [b](benchmarks/vision.md#fna-presets-speed-2026-12-01) '
        '[docs/benchmarks/vision.md, "FNA presets"](benchmarks/vision.md)\n')
    (tmp_path / "attnpatch" / "m.py").write_text(
        '"""Measured: docs/benchmarks/vision.md ("FNA presets: speed"); BENCHMARKS.md, "Summary"."""\n')
    assert broken_bench_references(tmp_path) == ([], 5)
    (tmp_path / "attnpatch" / "m.py").write_text(
        '"""docs/benchmarks/vision.md ("FNA presets,\n    again"); BENCHMARKS.md#nowhere; docs/benchmarks/gone.md#x;\n'
        'BENCHMARKS.md, "Vision"."""\n')
    bad, checked = broken_bench_references(tmp_path)
    assert checked == 7 and len(bad) == 4
    assert "BENCHMARKS.md#nowhere: no heading" in bad[0] and "gone.md#x: no such page" in bad[1]
    assert '"FNA presets, again"' in bad[2] and 'BENCHMARKS.md, "Vision"' in bad[3]


# --------------------------------------------------------------------------- what the documents say

#: A stated test count ("1,844 tests", "1844 passed", "the test count"): it goes stale with every test added.
TEST_COUNT = re.compile(r"\b\d[\d,]*\s+(?:tests|passed|skipped)\b|\btests?[ -]count\b", re.I)


def test_no_document_states_a_test_count():
    # the phrase the README used to carry, and phrases that are not a count
    assert TEST_COUNT.search("**Tests** (1,844 tests, 23 of them skipped in a clone with no `../shared/data`")
    assert TEST_COUNT.search("1844 passed, 23 skipped in 480s")
    for fine in ("the `slow` ones run the real checkpoints", "2-process runs", "ran beside a test run",
                 "about 8 min on 2 CPU cores", "the data-parallel tests start 2-process runs"):
        assert not TEST_COUNT.search(fine)
    found = [f"{p.relative_to(REPO)}:{i}: {m.group(0)!r}" for p in DOCS
             for i, line in enumerate(p.read_text().splitlines(), 1) for m in TEST_COUNT.finditer(line)]
    assert found == []


def test_every_page_starts_with_a_table_of_contents():
    for page in [*PAGES, REPO / "BENCHMARKS.md", *BENCH_PAGES]:
        text = page.read_text()
        first_section = text.find("\n## ")
        assert "**Contents**" in text[:first_section], f"{page.relative_to(REPO)}: no table of contents before its first section"


def _bash_blocks(text: str) -> str:
    return "\n".join(re.findall(r"```bash\n(.*?)```", text, re.S))


def test_readme_keeps_the_two_commands():
    """CI runs the test command written in the README (``.ci/run``), the README shows the fast subset's command beside
    it, and the main job's command is the README's."""
    readme = (REPO / "README.md").read_text()
    ci = [ln.strip() for ln in (REPO / ".ci" / "run").read_text().splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    assert ci[-1] == "python -m pytest -q"
    commands = _bash_blocks(readme).splitlines()
    assert ci[-1] in commands
    assert 'python -m pytest -q -m "not slow"' in commands  # the fast subset, beside the full suite
    assert ("attnpatch eval ruler --model smollm2-135m-instruct --method anchor_attention -o preset=accurate "
            "--lengths 1024 2048 4096 --samples 3 --depths 0 0.5 1") in commands
    assert len(readme.splitlines()) <= 320, "README.md is the front door: details go to docs/, measurements to BENCHMARKS.md"


def test_readme_method_table_names_every_method():
    import attnpatch

    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Methods"):]
    section = section[:section.index("\n## ", 1)]
    rows = {m.group(1) for m in re.finditer(r"^\| `([^`]+)` \|", section, re.M)}
    names = {m["name"] for m in attnpatch.list_methods() if not m["name"].startswith(("contract_", "throwaway"))}
    assert names <= rows, f"methods missing from the README's table: {sorted(names - rows)}"


#: Import paths of attnpatch/evals/ the documents may name (the rest is internal and moves).
PUBLIC_EVALS = re.compile(r"attnpatch\.evals\.(?:recall(?:\.attention_recall)?|bench(?:\.(?:bench_attention|bench_vision_model|bench_causal_lm))?)\b")


def test_docs_name_no_internal_evals_module():
    found = []
    for page in [REPO / "README.md", *PAGES]:
        for i, line in enumerate(page.read_text().splitlines(), 1):
            for m in re.finditer(r"attnpatch[./]evals[./][\w./]*", line):
                if not PUBLIC_EVALS.fullmatch(m.group(0).rstrip(".")):
                    found.append(f"{page.relative_to(REPO)}:{i}: {m.group(0)}")
    assert found == []


# --------------------------------------------------------------------------- BENCHMARKS.md and its renderer


def _make_benchmarks():
    spec = importlib.util.spec_from_file_location("make_benchmarks", REPO / "benchmarks" / "make_benchmarks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _bench_files() -> dict[str, bytes]:
    return {p.relative_to(REPO).as_posix(): p.read_bytes() for p in [REPO / "BENCHMARKS.md", *BENCH_PAGES]}


def test_benchmarks_is_a_front_page():
    """BENCHMARKS.md holds the headline figures and a line per area page; the full tables live on the pages."""
    text = (REPO / "BENCHMARKS.md").read_text()
    assert len(text.splitlines()) < 400, "BENCHMARKS.md is the front page: full tables go to docs/benchmarks/"
    for page in BENCH_PAGES:
        assert f"](docs/benchmarks/{page.name})" in text, f"the front page has no line for docs/benchmarks/{page.name}"
        assert "](../../BENCHMARKS.md)" in page.read_text(), f"{page.name} does not link back to the front page"


@pytest.mark.slow
def test_render_reproduces_the_committed_benchmarks(tmp_path):
    """``render --output DIR`` writes every page under DIR, each byte-equal to the committed one, and touches none."""
    before = _bench_files()
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "make_benchmarks.py"), "render", "--output", str(tmp_path)],
                   check=True, cwd=tmp_path, capture_output=True)
    assert _bench_files() == before, "render --output must not touch the committed pages"
    written = {p.relative_to(tmp_path).as_posix(): p.read_bytes() for p in tmp_path.rglob("*.md")}
    assert set(written) == set(before)
    stale = [name for name in before if written[name] != before[name]]
    assert stale == [], f"stale: {stale}; run `python benchmarks/make_benchmarks.py render`"


def test_every_benchmark_page_is_what_render_writes():
    """The front page and every docs/benchmarks/ page, rendered in memory from benchmarks/results/, equal the committed
    files: a table edited by hand inside a ``generated`` block, or a results file changed without ``render``, fails."""
    stale = _make_benchmarks().stale_pages()
    assert stale == {}, "".join(stale.values())[-4000:] + "\nrun `python benchmarks/make_benchmarks.py render`"


def test_stale_pages_finds_a_hand_edit_inside_a_generated_block(tmp_path):
    mb = _make_benchmarks()
    for name, data in _bench_files().items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(data)
    assert mb.stale_pages(tmp_path) == {}
    cpu = tmp_path / "docs" / "benchmarks" / "cpu.md"
    text = cpu.read_text()
    start = text.index("<!-- generated:cpu -->")
    row = re.search(r"\| 4097 \| fna \(s=64\) \| 8\.17ms \| 17\.42x", text[start:])
    assert row, "the FNA row the test edits is gone from the cpu block"
    cpu.write_text(text[:start + row.start()] + row.group(0).replace("17.42x", "27.42x") + text[start + row.end():])
    stale = mb.stale_pages(tmp_path)
    assert list(stale) == ["docs/benchmarks/cpu.md"] and "-| 4097 | fna (s=64) | 8.17ms | 27.42x" in stale["docs/benchmarks/cpu.md"]
    cpu.write_text(text)
    front = tmp_path / "BENCHMARKS.md"
    committed = front.read_text()
    front.write_text(committed.replace("- [Summary](#summary)\n", ""))  # inside the front page's table of contents
    assert list(mb.stale_pages(tmp_path)) == ["BENCHMARKS.md"]
    # the text outside the blocks is the page's own: editing it makes nothing stale
    front.write_text(committed.replace("## Summary\n", "## Summary\n\nA hand-written line.\n"))
    assert mb.stale_pages(tmp_path) == {}


def test_render_pages_writes_links_from_each_page(tmp_path):
    """A block on a page under docs/benchmarks/ links the plots relative to that page, and a link to a heading goes
    to the page that has it."""
    mb = _make_benchmarks()
    results = tmp_path / "results"
    (results / "cpu").mkdir(parents=True)
    (results / "cpu" / "fna.json").write_text((REPO / "benchmarks" / "results" / "cpu" / "fna.json").read_text())
    pages = {"BENCHMARKS.md": "# Benchmarks\n\n<!-- generated:intro -->\n<!-- /generated:intro -->\n\n## Summary\n",
             "docs/benchmarks/cpu.md": "# CPU\n\n<!-- generated:toc -->\n<!-- /generated:toc -->\n\n"
                                       "<!-- generated:cpu -->\n<!-- /generated:cpu -->\n",
             "docs/benchmarks/gpu.md": "# GPU\n\n## On a GPU (NVIDIA H200, 2026-11-30)\n"}
    out = mb.render_pages(pages, results)
    assert "![time](../../benchmarks/results/cpu/fna_time.png)" in out["docs/benchmarks/cpu.md"]
    assert "- [FNA attention vs SDPA (non-causal, one layer)](#fna-attention-vs-sdpa-non-causal-one-layer)" in out[
        "docs/benchmarks/cpu.md"]
    assert "[On a GPU](docs/benchmarks/gpu.md#on-a-gpu-nvidia-h200-2026-11-30)" in out["BENCHMARKS.md"]
    assert out["docs/benchmarks/gpu.md"] == pages["docs/benchmarks/gpu.md"]  # no block: kept as it is
    assert mb.render_pages(out, results) == out
    link = mb.linker("docs/benchmarks/gpu.md", {"the-triton-kernels-compiled-for-sm_90-and-sm_80": "docs/benchmarks/compile.md"})
    assert link("#the-triton-kernels-compiled-for-sm_90-and-sm_80") == "compile.md#the-triton-kernels-compiled-for-sm_90-and-sm_80"
    assert link("#elsewhere") == "#elsewhere" and link("BENCHMARKS.md#summary") == "../../BENCHMARKS.md#summary"


def test_render_keeps_hand_written_text_and_renders_each_results_folder(tmp_path):
    mb = _make_benchmarks()
    results = tmp_path / "results"
    (results / "cuda").mkdir(parents=True)
    (results / "claims").mkdir()
    fna = json.loads((REPO / "benchmarks" / "results" / "cpu" / "fna.json").read_text())
    (results / "cuda" / "fna.json").write_text(json.dumps({**fna, "note": "A note on this run."}))
    (results / "claims" / "other.json").write_text("{}")  # a folder of files render has no section for
    template = ("# Benchmarks\n\n<!-- generated:toc -->\nstale\n<!-- /generated:toc -->\n\n## Hand-written\n\n"
                "Kept as it is: [link](#hand-written).\n\n<!-- generated:cuda -->\nstale\n<!-- /generated:cuda -->\n\n"
                "## Also hand-written\n\n| a | b |\n|---|---|\n| 1 | 2 |\n")
    text = mb.render(template, results)
    assert "stale" not in text
    assert "## Hand-written\n\nKept as it is: [link](#hand-written).\n\n<!-- generated:cuda -->\n## Device: cuda\n" in text
    assert "### FNA attention vs SDPA (non-causal, one layer)" in text and "A note on this run." in text
    assert text.endswith("<!-- /generated:cuda -->\n\n## Also hand-written\n\n| a | b |\n|---|---|\n| 1 | 2 |\n")
    assert "Device: claims" not in text
    assert "- [Device: cuda](#device-cuda)\n  - [FNA attention vs SDPA" in text
    assert mb.render(text, results) == text  # idempotent: a second render changes nothing
    # a results folder without a block in the document gets one at the end
    shutil.copytree(results / "cuda", results / "tpu")
    appended = mb.render(text, results)
    assert "## Also hand-written\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n<!-- generated:tpu -->\n## Device: tpu\n" in appended
    assert appended.endswith("<!-- /generated:tpu -->\n") and "- [Device: tpu](#device-tpu)" in appended
    # an empty document gets the title, the table of contents and the intro
    fresh = mb.render(mb.DEFAULT_TEMPLATE, results)
    assert fresh.startswith("# Benchmarks\n\n<!-- generated:toc -->\n**Contents**") and "## Device: cuda" in fresh


@pytest.mark.slow
def test_render_check_option_reports_a_stale_file(tmp_path):
    """``render --check`` exits 0 on the committed pages; the test writes none of them."""
    before = _bench_files()
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "make_benchmarks.py"), "render", "--check"],
                          cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert _bench_files() == before
