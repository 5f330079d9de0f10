import json
import subprocess
import sys

import pytest

from indexcache.cli import main

V32_ARGS = ["plan", "--layers", "61", "--mtp-layers", "1", "--hf-overrides", '{"use_index_cache": true, "index_topk_freq": 4}']


def test_plan_text(capsys):
    assert main(V32_ARGS + ["--context", "4096"]) == 0
    out = capsys.readouterr().out
    assert "16 F / 45 S over 61 layers (+1 MTP, always F); freq 4, offset 2" in out
    assert "FFSSSFSSSF" in out
    lines = {line.split()[0]: line for line in out.splitlines() if line.strip() and line.split()[0].isdigit()}
    assert "reads indices of" in out
    assert lines["4"].split()[1:] == ["S", "layer", "1"]
    assert lines["5"].split()[1:] == ["F", "itself"]
    assert "(MTP)" in lines["61"]
    assert "73.8%" in out  # 45 of 61 layers' indexer work


def test_plan_json(capsys):
    assert main(V32_ARGS + ["--json", "--context", "1024"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["num_full"] == 16 and data["num_shared"] == 45
    assert [row["layer"] for row in data["layers"] if row["type"] == "F"] == [0, 1] + list(range(5, 58, 4)) + [61]
    assert data["layers"][3]["source_layer"] == 1
    c = data["costs"]["index_k_cache_bytes_per_sequence"]
    assert c["all_f"] == 61 * 1024 * 132 and c["plan"] == 16 * 1024 * 132


def test_plan_from_config_file(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 78, "index_topk_freq": 4, "index_skip_topk_offset": 3}))
    assert main(["plan", "--config", str(tmp_path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["num_full"] == 21 and data["shipped_by_checkpoint"]


@pytest.mark.parametrize(
    "argv,message",
    [
        (["plan"], "give --config PATH or --layers N"),
        (["plan", "--layers", "8", "--hf-overrides", "{bad"], "not valid JSON"),
        (["plan", "--layers", "8", "--hf-overrides", '{"use_index_cache": true, "index_topk_pattern": "SF"}'], "starts with 'S'"),
        (["plan", "--config", "/nonexistent/dir"], "no config.json"),
        (["generate", "--decode-threads", "0"], "--decode-threads '0': give 'auto' or a count >= 1"),
        (["generate", "--decode-threads", "many"], "--decode-threads 'many': give 'auto' or a count >= 1"),
        (["generate", "--prefill-threads", "0"], "--prefill-threads '0': give 'auto' or a count >= 1"),
    ],
)
def test_plan_errors(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_python_dash_m():
    out = subprocess.run([sys.executable, "-m", "indexcache", *V32_ARGS, "--json"], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout)["num_full"] == 16
