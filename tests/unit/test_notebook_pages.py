"""A notebook's page reads question → answer → figures → evidence: the answer block (this question's rows of the
answer table) right after the question's own cell, a table of contents, the settings dump and long tables folded,
the findings in full folded at the end under 'evidence' — built from an executed notebook and its report's records,
no kernel needed."""

import json

import nbformat
from records_factory import cell

from moe_lab.reporting import notebook_pages

SETTINGS = "{" + ",\n".join(f"'key{i}': {i}" for i in range(60)) + "}"


def _executed(tmp_path, *, records=True):
    nb = nbformat.v4.new_notebook()
    code = nbformat.v4.new_code_cell
    nb.cells = [
        nbformat.v4.new_markdown_cell("# 03 — promotion\n\n**Question**: does promotion make the ranks agree?"),
        code("P.public()", outputs=[nbformat.v4.new_output("execute_result", data={"text/plain": SETTINGS},
                                                           execution_count=1)]),
        nbformat.v4.new_markdown_cell("## Which settings make the ranks agree?"),
        code("plots.sweep_heatmap(records)", outputs=[nbformat.v4.new_output("stream", text="a figure\n")]),
        nbformat.v4.new_markdown_cell("## Verdict per release"),
        code("print(verdict)", metadata={"tags": ["verdict"]},
             outputs=[nbformat.v4.new_output("stream", text="- [PASS] every finding in full\n")]),
    ]
    path = tmp_path / "03_precision_promotion.ipynb"
    nbformat.write(nb, path)
    if records:
        recs = [cell("allgather", "none", cross=5, world=4), cell("allgather", "fp32", cross=0, world=4)]
        (tmp_path / "results.json").write_text(json.dumps(recs))
    return path


def test_page_opens_with_the_answer_and_folds_settings_and_evidence(tmp_path):
    page = notebook_pages.render_html(_executed(tmp_path), exclude_input=True).read_text()
    body = page.split("<body", 1)[1]
    question, answer = body.index("does promotion make the ranks agree"), body.index("id=\"answer\"")
    toc, first_section = body.index("On this page"), body.index("Which settings make the ranks agree?</a>")
    figure, evidence = body.index("a figure"), body.index("id=\"evidence\"")
    assert question < answer < toc <= first_section < figure < evidence
    assert 'class="answers"' in body and "fix found: router fp32" in body
    assert "NVIDIA H200</title>" in page  # the page's title names the machine its records ran on
    # the settings dump is folded, its 60 lines one click away
    assert "<summary>the run&#x27;s settings (60 lines)</summary>" in body or \
        "<summary>the run's settings (60 lines)</summary>" in body
    assert body.index("<details", body.index("does promotion")) < body.index("key59")
    # every section is linked from the table of contents and has its anchor
    for sec in ("sec-2", "sec-4"):
        assert f'href="#{sec}"' in body and f"id=\"{sec}\"" in body.replace("'", '"')


def test_short_outputs_stay_open_and_a_page_without_records_has_no_answer(tmp_path):
    """The controls: a short output is not folded; without records the answer says nothing was measured, no table."""
    page = notebook_pages.render_html(_executed(tmp_path, records=False)).read_text()
    assert "NOT MEASURED</span> no records" in page and 'class="answers"' not in page
    body = page.split("<body", 1)[1]
    a_figure = body.index("a figure")
    assert "<details" not in body[body.rindex("<div", 0, a_figure) - 400:a_figure]


def test_an_interrupt_replaces_the_banner_of_the_failure_it_caused(tmp_path):
    """A run stopped by SIGTERM stops the engines under a notebook, whose own failure (a cluster fault) can be marked
    first: the interrupt's mark then says SIGTERM, once, as the index row does; the cell's error output stays. The
    control: an ordinary second mark keeps the first."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("run()", metadata={"papermill": {"start_time": "t"}}, execution_count=1,
                                          outputs=[nbformat.v4.new_output("error", ename="ClusterError",
                                                                          evalue="engines stopped", traceback=[])])]
    path = tmp_path / "01_t.ipynb"
    nbformat.write(nb, path)
    assert notebook_pages.mark_failure(path, "ClusterError: engines stopped")
    assert not notebook_pages.mark_failure(path, "KeyboardInterrupt: interrupted (SIGTERM)")  # the control
    assert "SIGTERM" not in path.read_text()
    assert notebook_pages.mark_failure(path, "KeyboardInterrupt: interrupted (SIGTERM)", replace=True)
    cells = nbformat.read(path, as_version=4).cells
    banners = [c for c in cells if "moe_lab-failure" in c.metadata.get("tags", [])]
    assert len(banners) == 1 and "interrupted (SIGTERM)" in banners[0].source and "engines stopped" not in banners[0].source
    assert cells[-1].outputs[0]["ename"] == "ClusterError"
