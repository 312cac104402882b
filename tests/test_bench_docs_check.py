"""`bench-docs --check` over the published docs, and the general table kinds on tiny in-memory JSON."""

import json
from pathlib import Path

import pytest

from hf_adaptive_spec.bench import docs as bench_docs
from hf_adaptive_spec.bench.docs_rows import format_range, pick, rows_table

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", ["docs/benchmarks.md", "README.md"])
def test_every_marked_table_equals_its_results_file(name):
    assert bench_docs.refresh(ROOT / name, check=True) == []


RUNS = {"runs": [
    {"method": "off", "rate": 1.0, "repeat": 0, "lat": {"mean": 2.0}, "share": 1.0},
    {"method": "fast", "rate": 1.0, "repeat": 0, "lat": {"mean": 1.0}, "share": 0.25},
    {"method": "off", "rate": 1.0, "repeat": 1, "lat": {"mean": 4.0}, "share": 1.0},
    {"method": "fast", "rate": 1.0, "repeat": 1, "lat": {"mean": 3.0}, "share": 0.5},
    {"method": "off", "rate": 2.0, "repeat": 0, "lat": {"mean": 5.0}, "share": 1.0},
    {"method": "fast", "rate": 2.0, "repeat": 0, "lat": None, "share": True},
]}


def test_rows_one_row_per_record_with_a_filter_and_formats():
    lines = bench_docs.render_table(RUNS, "rows", "runs", "where:method=fast&rate=1", "rate=rate:g", "who=method",
                                    "latency=lat.mean:.2f", "share=share:{:.0%}")
    assert lines == ["| rate | who | latency | share |", "|---:|---|---:|---:|",
                     "| 1 | fast | 1.00 | 25% |", "| 1 | fast | 3.00 | 50% |"]


def test_rows_groups_pair_ratios_and_aggregate():
    lines = bench_docs.render_table(
        RUNS, "rows", "runs", "by:rate", "rule:|--:|--:|---|---|", "rate=rate:g", "off=lat.mean@method=off|mean:.1f",
        "vs off=lat.mean@method=fast/lat.mean@method=off|listmean:{:.2f}x", "share=share@method=fast|range:{:.0%}")
    assert lines == ["| rate | off | vs off | share |", "|--:|--:|---|---|",
                     "| 1 | 3.0 | 0.50x, 0.75x (mean 0.62x) | 25-50% |",
                     "| 2 | 5.0 | – | yes |"]


def test_rows_over_a_mapping_and_the_other_aggregates():
    data = {"by": {"a": {"x": 1}, "b": {"x": 3}, "c": 7}}
    assert bench_docs.render_table(data, "rows", "by", "key=_key", "x=x", "v=_value") == [
        "| key | x | v |", "|---|---|---|", "| a | 1 | – |", "| b | 3 | – |", "| c | – | 7 |"]
    assert bench_docs.render_table(data, "rows", "by", "by:missing", "sum=x|sum:g", "n=x|list:g", "lo=x|min:g",
                                   "hi=x|max:g", "first=_key") == [
        "| sum | n | lo | hi | first |", "|---:|---:|---:|---:|---|", "| 4 | 1, 3, – | 1 | 3 | a |"]


def test_rows_refuses_what_it_cannot_draw():
    with pytest.raises(ValueError, match="no list or mapping"):
        bench_docs.render_table({"n": 1}, "rows", "n", "x=x")
    with pytest.raises(ValueError, match="unknown aggregate"):
        bench_docs.render_table(RUNS, "rows", "runs", "x=rate|median")
    with pytest.raises(ValueError, match="at least one column"):
        bench_docs.render_table(RUNS, "rows", "runs", "by:rate")
    with pytest.raises(ValueError, match="at most one argument"):
        bench_docs.render_table({}, "arrivals", "x", "y")


def test_pick_and_ranges():
    assert pick({"a": [{"b": 5}]}, "a.0.b") == 5 and pick({"a": 1}, "b") is None and pick([1], ".") == [1]
    assert format_range([1.0, 2.5, None], "{:.2f}x") == "1.00-2.50x"
    assert format_range([2.0, 2.001], "{:.2f}") == "2.00"
    assert format_range([None], "{:.2f}") == "–"


def test_memory_and_cold_kinds_are_the_modes_own_tables():
    memory = {"records": [{"method": "plain", "prompt_tokens": 8, "peak_growth_bytes": 2 ** 20, "matches_plain": True},
                          {"method": "sage", "prompt_tokens": 8, "peak_growth_bytes": 3 * 2 ** 20,
                           "matches_plain": True}]}
    assert bench_docs.render_table(memory, "memory") == [
        "| method | 8 tokens: MiB | vs plain |", "|---|---:|---:|", "| plain | 1 | 1.00x |", "| sage | 3 | 3.00x |"]
    memory["records"][0]["decode_peak_growth_bytes"] = 2 ** 19
    memory["records"][1].update(decode_peak_growth_bytes=2 * 2 ** 20, phase_peak_growth_bytes={
        "prefill": 3 * 2 ** 20, "start_rounds": 2 ** 20, "first_round": 2 * 2 ** 20, "rounds": 2 * 2 ** 20})
    assert bench_docs.render_table(memory, "memory", "phases")[2] == "| sage | 8 | 3 | 1 | 2 | 2 | 3 | 1 | 2 | 0 |"
    with pytest.raises(ValueError, match="phases"):
        bench_docs.render_table(memory, "memory", "steps")
    calls = [{"call": name, "seconds": seconds, "time_setup": 0.01} for name, seconds in
             [("plain 1", 4.0), ("s 1", 2.0), ("s 2", 1.5), ("s 3", 1.0), ("plain 2", 3.0), ("s warmed", 1.0)]]
    cold = {"records": [{"strategy": "s", "calls": calls, "first_vs_plain": 1.5, "first_vs_first_plain": 2.0,
                         "third_vs_warmed": 1.0, "same_as_plain": True}]}
    assert bench_docs.render_table(cold, "cold")[2] == (
        "| s | 4.00 | 2.00 | 1.50 | 1.00 | 3.00 | 1.00 | 2.00x | 1.50x | 1.00 | 0.010 | yes |")


def _bench_results(date: str, tau: float, speedup: float, mode: float) -> dict:
    summary = {"tau": tau, "speedup_vs_plain": speedup, "speedup_vs_plain_mode": mode}
    return {"environment": {"started": date + "T01:00:00+00:00", "cpu_model": "Intel(R) Xeon(R) Processor",
                            "threads": 2},
            "aggregates": {"overall": {"m": summary}, "datasets": {"d": {"m": summary, "base": summary}}}}


def test_headline_rows_give_ranges_over_named_runs(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps(_bench_results("2026-01-01", 2.0, 1.5, 1.1)))
    (tmp_path / "b.json").write_text(json.dumps(_bench_results("2026-01-02", 2.5, 1.25, 1.1)))
    sweep = {"environment": {"started": "2026-01-03", "cpu_model": "AMD EPYC", "threads": 2},
             "records": [{"method": "m", "tau": 1.5, "speedup_vs_plain": 2.0, "speedup_vs_plain_mode": 0.9},
                         {"method": "m", "tau": 1.0, "speedup_vs_plain": 1.0, "speedup_vs_plain_mode": 1.0},
                         {"method": "m", "error": "boom", "tau": 9.0}]}
    (tmp_path / "sweep.json").write_text(json.dumps(sweep))
    doc = tmp_path / "README.md"
    doc.write_text("<!-- bench-table: headline model | note\n"
                   "a.json,b.json d m | pair | base {base.speedup}\n"
                   "sweep.json levels m | batched | plain\n"
                   "-->\nold\n<!-- /bench-table -->\n")
    assert bench_docs.refresh(doc) != [] and bench_docs.refresh(doc, check=True) == []
    assert doc.read_text().split("-->\n", 1)[1].splitlines()[:4] == [
        "| model | note | tau | vs plain | vs plain mode | measured |", "|---|---|---:|---:|---:|---|",
        "| pair | base 1.25-1.50x | 2.00-2.50 | 1.25-1.50x | 1.10x | 2026-01-01 and 2026-01-02, Intel Xeon, 2 cores |",
        "| batched | plain | 1.00-1.50 | 1.00-2.00x | 0.90-1.00x | 2026-01-03, AMD EPYC, 2 cores |"]
    doc.write_text("<!-- bench-table: headline model\nmissing.json d m | x\n-->\n<!-- /bench-table -->\n")
    with pytest.raises(FileNotFoundError, match="missing.json"):
        bench_docs.refresh(doc)


def test_a_marker_of_quoted_arguments_over_several_lines(tmp_path):
    (tmp_path / "r.json").write_text(json.dumps(RUNS))
    doc = tmp_path / "doc.md"
    doc.write_text('<!-- bench-table: r.json rows runs where:rate=2\n    "the method=method" -->\nold\n'
                   "<!-- /bench-table -->\n")
    assert bench_docs.refresh(doc) == ["r.json rows runs where:rate=2"]
    assert doc.read_text().endswith("-->\n| the method |\n|---|\n| off |\n| fast |\n<!-- /bench-table -->\n")


def _run_file(spec_config: str, plain_s: float, fast_s: float, drafted: int, rounds: int) -> dict:
    return {"environment": {"started": "2026-01-01T01:00:00+00:00"}, "args": {"spec_config": spec_config},
            "records": [{"method": "plain", "time_s": plain_s, "new_tokens": 8},
                        {"method": "fast", "time_s": fast_s / 2, "new_tokens": 4, "tau_num": 4, "tau_den": 2,
                         "stats": {"drafted": drafted, "rounds": rounds}},
                        {"method": "fast", "time_s": fast_s / 2, "new_tokens": 4, "tau_num": 4, "tau_den": 1,
                         "stats": {"drafted": drafted * 3, "rounds": rounds}}]}


def test_rows_from_several_files_with_labels_pooled_ratios_and_a_default_row(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps(_run_file("default", 4.0, 2.0, 2, 1)))
    (tmp_path / "b.json").write_text(json.dumps(_run_file("wide", 4.0, 4.0, 10, 1)))
    doc = tmp_path / "doc.md"
    doc.write_text('<!-- bench-table: rows records by:_label\n'
                   '    "from:a.json=default | none" "from:b.json=every node | a store" from:a.json#[args]\n'
                   '    "setting=_labels.0" "store=_labels.1"\n'
                   '    "tau=tau_num@method=fast/tau_den@method=fast|pooled:.2f"\n'
                   '    "nodes=stats.drafted/stats.rounds|pooled:.1f"\n'
                   '    "tok/s=new_tokens@method=fast/time_s@method=fast|pooled:.1f"\n'
                   '    "vs default=time_s@method=plain/time_s@method=fast|pooled~_labels.0=default:{:.2f}x"\n'
                   '    "config=spec_config" -->\nold\n<!-- /bench-table -->\n')
    assert bench_docs.refresh(doc) == ["rows records by:_label"] and bench_docs.refresh(doc, check=True) == []
    assert doc.read_text().split("-->\n", 1)[1].splitlines()[:-1] == [
        "| setting | store | tau | nodes | tok/s | vs default | config |",
        "|---|---|---:|---:|---:|---:|---|",
        "| default | none | 2.67 | 4.0 | 4.0 | 1.00x | – |",
        "| every node | a store | 2.67 | 20.0 | 2.0 | 0.50x | – |",
        "| a.json | – | – | – | – | – | default |"]


def test_rows_one_record_in_brackets_and_a_missing_default_row(tmp_path):
    info = {"evals": [{"step": 9, "color": 0.5}], "blank_image": {"color": 0.125, "samples": [1, 2]}}
    (tmp_path / "info.json").write_text(json.dumps(info))
    lines = rows_table(None, ["evals", "from:info.json=trained", "from:info.json#[blank_image]=blank",
                                         "image=_label", "colour=color:.3f", "vs trained=color~_label=none:.2f"],
                                  tmp_path / "doc.md")
    assert lines == ["| image | colour | vs trained |", "|---|---:|---:|",
                     "| trained | 0.500 | – |", "| blank | 0.125 | – |"]
    assert bench_docs.render_table(info, "rows", "[blank_image]", "c=color", "n=samples.1") == [
        "| c | n |", "|---|---|", "| 0.125 | 2 |"]
    dates = {"runs": [{"at": "2026-01-02T05:00"}, {"at": "2026-01-01T09:30"}]}
    assert bench_docs.render_table(dates, "rows", "runs", "by:missing", "first=at|min:.10", "last=at|max:.10") == [
        "| first | last |", "|---:|---:|", "| 2026-01-01 | 2026-01-02 |"]


def test_rows_from_files_refuses_what_it_cannot_draw(tmp_path):
    (tmp_path / "r.json").write_text(json.dumps(RUNS))
    with pytest.raises(FileNotFoundError, match="missing.json"):
        rows_table(None, ["runs", "from:missing.json", "x=rate"], tmp_path / "doc.md")
    with pytest.raises(ValueError, match="needs 'from:"):
        rows_table(None, ["runs", "x=rate"], tmp_path / "doc.md")
    with pytest.raises(ValueError, match="not both"):
        bench_docs.render_table(RUNS, "rows", "runs", "from:r.json", "x=rate")
    with pytest.raises(ValueError, match="takes a ratio"):
        bench_docs.render_table(RUNS, "rows", "runs", "x=rate|pooled")
    with pytest.raises(ValueError, match="relative to a row"):
        bench_docs.render_table(RUNS, "rows", "runs", "x=rate|range~rate=1")
    with pytest.raises(ValueError, match="no mapping to take as one record"):
        bench_docs.render_table(RUNS, "rows", "[runs]", "x=rate")
