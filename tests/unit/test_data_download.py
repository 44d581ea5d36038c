"""download(): against a local HTTP server, with the URL table pointed at it."""

import functools
import gzip
import hashlib
import http.server
import io
import tarfile
import threading

import pytest
from helpers import write_cifar, write_fmnist

from vitscale.data import home
from vitscale.data.offline import fetch as dl
from vitscale.data.sources import cifar, fashion_mnist
from vitscale.errors import DataError


@pytest.fixture
def server(tmp_path):
    """Serves tmp_path/www at http://127.0.0.1:PORT/ from a thread."""
    www = tmp_path / "www"
    www.mkdir()

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):  # no access log on stderr
            pass

    handler = functools.partial(Quiet, directory=str(www))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(
        target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
    ).start()
    yield www, f"http://127.0.0.1:{httpd.server_address[1]}/"
    httpd.shutdown()
    httpd.server_close()


def md5(path):
    return hashlib.md5(path.read_bytes()).hexdigest()


def make_cifar_archive(tmp_path, www):
    base, _ = write_cifar(tmp_path / "src", "cifar10")
    archive = www / "cifar-10-python.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(base, arcname="cifar-10-batches-py")
    return archive


def test_cifar_download_md5_ok(tmp_path, server, monkeypatch):
    www, url = server
    archive = make_cifar_archive(tmp_path, www)
    monkeypatch.setitem(
        dl.SOURCES, "cifar10", ("cifar-10-batches-py", [(url + archive.name, md5(archive))], True)
    )
    root = tmp_path / "data"
    dest = dl.download("cifar10", root)
    assert dest == root / "cifar-10-batches-py" and (dest / "data_batch_5").is_file()
    assert sorted(p.name for p in root.iterdir()) == ["cifar-10-batches-py"]  # no temp/archive left
    assert cifar.load("cifar10", root).train_x.shape == (15, 3, 32, 32)
    archive.unlink()  # already there: no fetch
    assert dl.download("cifar10", root, progress=False) == dest


def test_download_md5_mismatch_removes_file(tmp_path, server, monkeypatch):
    www, url = server
    archive = make_cifar_archive(tmp_path, www)
    monkeypatch.setitem(
        dl.SOURCES, "cifar10", ("cifar-10-batches-py", [(url + archive.name, "0" * 32)], True)
    )
    root = tmp_path / "data"
    with pytest.raises(DataError, match="md5 .* != expected 0000") as e:
        dl.download("cifar10", root, progress=False)
    assert "\n" not in str(e.value)
    assert list(root.iterdir()) == []  # the bad file removed


def test_fashion_mnist_download_and_env_home(tmp_path, server, monkeypatch):
    www, url = server
    write_fmnist(www)
    files = [(url + f, md5(www / f)) for f in home.FMNIST_FILES]
    monkeypatch.setitem(dl.SOURCES, "fashion_mnist", ("fashion-mnist", files, False))
    monkeypatch.setenv("VITSCALE_DATA", str(tmp_path / "home"))
    dest = dl.download("fashion-mnist", progress=False)
    assert dest == tmp_path / "home" / "fashion-mnist"
    assert home.default_root("fashion_mnist") == dest  # found there next time
    assert len(fashion_mnist.load().train_y) == 12  # root "" -> default_root


def test_network_failure_is_one_line(tmp_path, server, monkeypatch):
    www, url = server
    monkeypatch.setitem(
        dl.SOURCES, "cifar100", ("cifar-100-python", [(url + "missing.tar.gz", "0" * 32)], True)
    )
    with pytest.raises(DataError, match="download of .*missing.tar.gz failed"):
        dl.download("cifar100", tmp_path / "d", progress=False)
    monkeypatch.setitem(
        dl.SOURCES,
        "cifar100",
        ("cifar-100-python", [("http://127.0.0.1:9/x.tar.gz", "0" * 32)], True),
    )
    with pytest.raises(DataError, match="failed"):
        dl.download("cifar100", tmp_path / "d", progress=False)
    assert [p.name for p in (tmp_path / "d").iterdir()] == []


def test_unsafe_archive_member_refused(tmp_path, server, monkeypatch):
    www, url = server
    archive = www / "evil.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        info = tarfile.TarInfo("../escaped.txt")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"bad"))
    monkeypatch.setitem(
        dl.SOURCES, "cifar10", ("cifar-10-batches-py", [(url + archive.name, md5(archive))], True)
    )
    with pytest.raises(DataError, match="unsafe archive member '../escaped.txt'"):
        dl.download("cifar10", tmp_path / "d", progress=False)
    assert not (tmp_path / "escaped.txt").exists()


def test_unknown_name_and_default_roots(tmp_path, monkeypatch):
    with pytest.raises(DataError, match="unknown dataset 'mnist'"):
        dl.download("mnist")
    monkeypatch.setenv("VITSCALE_DATA", str(tmp_path))
    assert home.default_root("cifar-10") == tmp_path / "cifar-10-batches-py"
    assert home.default_root("cifar100") == tmp_path / "cifar-100-python"
    if home.SYSTEM_FMNIST.is_dir():  # Debian package fallback
        assert home.default_root("fashion-mnist") == home.SYSTEM_FMNIST


@pytest.mark.skipif(
    not (home.SYSTEM_FMNIST / home.FMNIST_FILES[0]).exists(), reason="no Debian copy"
)
def test_debian_copies_are_the_official_files():
    """Debian strips the gzip header's name and mtime; same payload, so md5s differ by design."""
    official = dict((u.rsplit("/", 1)[1], m) for u, m in dl.SOURCES["fashion_mnist"][1])
    f = home.SYSTEM_FMNIST / "t10k-labels-idx1-ubyte.gz"
    assert md5(f) == dl.DEBIAN_MD5[f.name]
    data = f.read_bytes()
    original = (
        b"\x1f\x8b\x08\x08"
        + (1504176627).to_bytes(4, "little")
        + b"\x00\x03"
        + b"t10k-labels-idx1-ubyte\x00"
        + data[10:]
    )
    assert hashlib.md5(original).hexdigest() == official[f.name]
    assert gzip.decompress(original) == gzip.decompress(data)
