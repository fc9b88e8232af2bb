"""scripts/uv_flags.py: uv is told what pip on this machine would use, so that scripts/setup's
uv installs resolve as pip's would (pip.conf files, PIP_* variables over them)."""

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("uv_flags", ROOT / "scripts" / "uv_flags.py")
uv_flags = importlib.util.module_from_spec(spec)
spec.loader.exec_module(uv_flags)

LISTING = """\
:env:.default-timeout='180'
:env:.find-links='/opt/wheels'
global.cert='/etc/ssl/certs/ca-certificates.crt'
global.constraint='/etc/xdg/pip/constraints.txt'
global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'
global.find-links='/elsewhere'
global.index-url='https://mirror.example/simple'
freeze.all='true'
"""


def test_a_variable_overrides_the_file_and_lists_become_one_flag_each():
    settings = uv_flags.pip_settings(LISTING)
    assert settings["find-links"] == "/opt/wheels"  # PIP_FIND_LINKS over pip.conf
    assert "all" not in settings  # another command's section
    assert uv_flags.uv_flags(settings) == [
        "--index-strategy", "unsafe-best-match",
        "--index-url", "https://mirror.example/simple",
        "--extra-index-url", "file:///opt/pypi/simple",
        "--extra-index-url", "file:///opt/pypi-more/simple",
        "--find-links", "/opt/wheels",
        "--constraint", "/etc/xdg/pip/constraints.txt",
    ]  # fmt: skip


def test_no_index_and_an_empty_configuration():
    assert uv_flags.uv_flags({"no-index": "true"}) == [
        "--index-strategy", "unsafe-best-match", "--no-index",
    ]  # fmt: skip
    assert uv_flags.pip_settings("") == {}


def test_the_script_prints_what_this_machines_pip_is_configured_with():
    """Run as scripts/setup runs it: the certificate first (for the caller to export), then
    the flags; whatever pip.conf this machine has, pip's strategy is always there."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "uv_flags.py")],
        capture_output=True, text=True, check=True,
    ).stdout.splitlines()  # fmt: skip
    flags = [line for line in out if not line.startswith("SSL_CERT_FILE=")]
    assert flags[:2] == ["--index-strategy", "unsafe-best-match"]
    listing = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True
    ).stdout
    for value in uv_flags.pip_settings(listing).get("find-links", "").split():
        assert value in flags
