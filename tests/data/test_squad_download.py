"""The SQuAD download helper against a local HTTP server on 127.0.0.1 (never the real site)."""

from __future__ import annotations

import hashlib
import http.server
import threading

import pytest

from jonebit.cli import main
from jonebit.data.squad_download import SQUAD_V1_1, DownloadError, OfficialFile, download_squad, verify_file

GOOD = b'{"version": "1.1", "data": []}\n' * 1000


class _Handler(http.server.BaseHTTPRequestHandler):
    routes: dict = {}
    requests: list = []

    def do_GET(self):  # noqa: N802 (http.server's name)
        type(self).requests.append(self.path)
        body = self.routes.get(self.path.rsplit("/", 1)[-1])
        if body is None:
            self.send_error(404)
            return
        declared, sent = body
        self.send_response(200)
        self.send_header("Content-Length", str(declared))
        self.end_headers()
        self.wfile.write(sent)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    _Handler.routes, _Handler.requests = {}, []
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/dataset/", _Handler
    httpd.shutdown()
    httpd.server_close()


def _expected(content: bytes, name="dev-v1.1.json") -> dict:
    return {"dev": OfficialFile(name, len(content), hashlib.sha256(content).hexdigest())}


def test_official_constants():
    dev, train = SQUAD_V1_1["dev"], SQUAD_V1_1["train"]
    assert (dev.name, dev.size, dev.sha256[:8]) == ("dev-v1.1.json", 4_854_279, "95aa6a52")
    assert (train.name, train.size, train.sha256[:8]) == ("train-v1.1.json", 30_288_272, "35276639")
    assert all(len(f.sha256) == 64 for f in SQUAD_V1_1.values())


def test_download_verifies_and_reuses(server, tmp_path):
    url, handler = server
    handler.routes["dev-v1.1.json"] = (len(GOOD), GOOD)
    paths = download_squad(tmp_path / "squad", ["dev"], base_url=url, files=_expected(GOOD))
    assert paths["dev"].read_bytes() == GOOD and handler.requests == ["/dataset/dev-v1.1.json"]
    assert sorted(p.name for p in (tmp_path / "squad").iterdir()) == ["dev-v1.1.json"]
    # present and valid: verified, not fetched again
    download_squad(tmp_path / "squad", ["dev"], base_url=url, files=_expected(GOOD))
    assert len(handler.requests) == 1


@pytest.mark.parametrize("sent, match", [
    (GOOD[:-100], "got 30,900 bytes, the official dev-v1.1.json has 31,000"),  # cut short
    (GOOD[:-1] + b"!", "sha256 [0-9a-f]{64}, the official dev-v1.1.json has"),  # same size, other bytes
    (GOOD + b"extra", "more than the official 31,000 bytes"),
])
def test_download_refuses_partial_or_corrupt(server, tmp_path, sent, match):
    url, handler = server
    handler.routes["dev-v1.1.json"] = (len(sent), sent)
    with pytest.raises(DownloadError, match=match):
        download_squad(tmp_path, ["dev"], base_url=url, files=_expected(GOOD))
    assert list(tmp_path.iterdir()) == []  # neither the file nor a .part is left


def test_download_refuses_connection_closed_early(server, tmp_path):
    url, handler = server
    handler.routes["dev-v1.1.json"] = (len(GOOD), GOOD[:-100])  # announces the full length, sends less
    with pytest.raises(DownloadError, match="(could not download|was cut short)"):
        download_squad(tmp_path, ["dev"], base_url=url, files=_expected(GOOD))
    assert list(tmp_path.iterdir()) == []  # neither the file nor a .part is left


def test_download_http_error_and_bad_arguments(server, tmp_path):
    url, _ = server
    with pytest.raises(DownloadError, match="could not download .*dev-v1.1.json.*404"):
        download_squad(tmp_path, ["dev"], base_url=url, files=_expected(GOOD))
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match=r"splits: expected some of \['dev', 'train'\], got \['test'\]"):
        download_squad(tmp_path, ["test"])
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="directory: .* is not a directory"):
        download_squad(tmp_path / "file", ["dev"])


def test_existing_corrupt_file_is_left_alone(server, tmp_path):
    url, handler = server
    handler.routes["dev-v1.1.json"] = (len(GOOD), GOOD)
    (tmp_path / "dev-v1.1.json").write_bytes(b"mine")
    with pytest.raises(DownloadError, match="4 bytes, but the official dev-v1.1.json has 31,000 .* delete it"):
        download_squad(tmp_path, ["dev"], base_url=url, files=_expected(GOOD))
    assert (tmp_path / "dev-v1.1.json").read_bytes() == b"mine" and handler.requests == []
    with pytest.raises(DownloadError, match="sha256"):
        verify_file(tmp_path / "dev-v1.1.json", OfficialFile("dev-v1.1.json", 4, "0" * 64))


def test_squad_download_command_reports_failure(monkeypatch, tmp_path, capsys):
    def refuse(url, timeout):
        raise OSError(f"no network in tests ({url})")

    monkeypatch.setattr("urllib.request.urlopen", refuse)
    assert main(["squad-download", str(tmp_path), "--split", "dev"]) == 1
    err = capsys.readouterr().err
    assert "could not download https://rajpurkar.github.io/SQuAD-explorer/dataset/dev-v1.1.json" in err
    assert list(tmp_path.iterdir()) == []
