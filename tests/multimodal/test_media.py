"""vllm/multimodal/media.py: an image URL (data:, http(s)://, file://) loaded as an RGB
PIL image, every failure a short ValueError. HTTP is served by a local http.server
thread; every fetch runs under a short timeout, so no test can hang."""

from __future__ import annotations

import base64
import http.server
import io
import socket
import threading
import time

import pytest
from PIL import Image

from vllm.multimodal.media import MAX_IMAGE_BYTES, load_image

pytestmark = pytest.mark.timeout(60)

TIMEOUT = 0.5  # seconds a test fetch may take


def image_bytes(fmt: str = "PNG", mode: str = "RGB", size=(5, 3), color=(10, 200, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size, color).save(buf, format=fmt)
    return buf.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


# -- data URLs ----------------------------------------------------------------------------
def test_png_data_url():
    image = load_image(data_url(image_bytes("PNG")))
    assert (image.mode, image.size) == ("RGB", (5, 3))
    assert image.getpixel((4, 2)) == (10, 200, 30)  # lossless: the very pixel


def test_jpeg_data_url():
    image = load_image(data_url(image_bytes("JPEG", size=(16, 8)), "image/jpeg"))
    assert (image.mode, image.size) == ("RGB", (16, 8))
    assert all(abs(a - b) < 12 for a, b in zip(image.getpixel((8, 4)), (10, 200, 30), strict=True))


def test_other_modes_become_rgb_and_transparency_becomes_white():
    gray = load_image(data_url(image_bytes(mode="L", color=77)))
    assert gray.mode == "RGB" and gray.getpixel((0, 0)) == (77, 77, 77)
    # vLLM's rgba_to_rgb: transparent pixels on a white background (a plain convert
    # would keep the hidden colour, here black).
    clear = load_image(data_url(image_bytes(mode="RGBA", color=(0, 0, 0, 0))))
    assert clear.mode == "RGB" and clear.getpixel((1, 1)) == (255, 255, 255)
    opaque = load_image(data_url(image_bytes(mode="RGBA", color=(9, 8, 7, 255))))
    assert opaque.getpixel((1, 1)) == (9, 8, 7)


def test_bad_base64_is_refused_without_echoing_the_data():
    with pytest.raises(ValueError, match="not valid base64") as e:
        load_image("data:image/png;base64," + "!" * 1_000_000)
    assert len(str(e.value)) < 300
    with pytest.raises(ValueError, match="not valid base64"):
        load_image("data:image/png;base64,abc")  # bad padding


@pytest.mark.parametrize(
    "url, match",
    [
        ("data:image/png,rawbytes", "only base64"),
        ("data:image/png;base64" + "A" * 500, "no ','"),
    ],
)
def test_malformed_data_urls(url, match):
    with pytest.raises(ValueError, match=match) as e:
        load_image(url)
    assert len(str(e.value)) < 300


def test_bytes_that_are_no_image_are_refused():
    with pytest.raises(ValueError, match="cannot be decoded as an image"):
        load_image(data_url(b"hello, not an image at all"))
    truncated = image_bytes("PNG", size=(64, 64))[:60]
    with pytest.raises(ValueError, match="cannot be decoded as an image"):
        load_image(data_url(truncated))


def test_decompression_bomb_limit_stays_on(monkeypatch):
    assert Image.MAX_IMAGE_PIXELS is not None  # importing media.py did not lift it
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 10)
    # 100 pixels: over twice the limit, refused before decoding.
    with pytest.raises(ValueError, match="too large to decode"):
        load_image(data_url(image_bytes(size=(10, 10))))


def test_oversize_data_url_is_refused_before_decoding():
    url = data_url(image_bytes(size=(64, 64)))
    assert load_image(url, max_bytes=MAX_IMAGE_BYTES).size == (64, 64)
    with pytest.raises(ValueError, match="at most 100 bytes"):
        load_image(url, max_bytes=100)


@pytest.mark.parametrize("url", ["ftp://example.com/a.png", "image.png", "", "C:/x.png"])
def test_other_schemes_are_refused(url):
    with pytest.raises(ValueError, match="is not a data:, http://, https:// or file:// URL"):
        load_image(url)


def test_a_non_string_is_refused():
    with pytest.raises(ValueError, match="must be a string"):
        load_image(b"data:image/png;base64,")  # type: ignore[arg-type]


# -- file:// ------------------------------------------------------------------------------
@pytest.fixture
def media_dir(tmp_path):
    root = tmp_path / "media"
    root.mkdir()
    (root / "a.png").write_bytes(image_bytes(size=(7, 2)))
    (tmp_path / "secret.png").write_bytes(image_bytes(size=(9, 9)))
    return root


def test_file_urls_are_refused_without_the_flag(media_dir):
    with pytest.raises(ValueError, match="start the server with --allowed-local-media-path"):
        load_image((media_dir / "a.png").as_uri())


def test_file_url_inside_the_allowed_path(media_dir):
    image = load_image((media_dir / "a.png").as_uri(), allowed_local_media_path=str(media_dir))
    assert (image.mode, image.size) == ("RGB", (7, 2))
    # The host "localhost" is this machine too.
    url = "file://localhost" + str(media_dir / "a.png")
    assert load_image(url, allowed_local_media_path=str(media_dir)).size == (7, 2)


def test_file_urls_outside_the_allowed_path_are_refused(media_dir):
    root = str(media_dir)
    outside = media_dir.parent / "secret.png"
    (media_dir / "link.png").symlink_to(outside)
    for url in (
        outside.as_uri(),
        f"file://{media_dir}/../secret.png",  # climbs out
        (media_dir / "link.png").as_uri(),  # a link inside, leading out
        media_dir.as_uri(),  # the folder itself is no file under it
    ):
        with pytest.raises(ValueError, match="is not inside --allowed-local-media-path"):
            load_image(url, allowed_local_media_path=root)
    with pytest.raises(ValueError, match="only local files"):
        load_image(f"file://example.com{media_dir}/a.png", allowed_local_media_path=root)


def test_file_errors(media_dir):
    root = str(media_dir)
    with pytest.raises(ValueError, match="cannot be read"):
        load_image((media_dir / "missing.png").as_uri(), allowed_local_media_path=root)
    with pytest.raises(ValueError, match="at most 50 bytes"):
        load_image((media_dir / "a.png").as_uri(), allowed_local_media_path=root, max_bytes=50)
    (media_dir / "notes.png").write_bytes(b"plain text")
    with pytest.raises(ValueError, match="cannot be decoded as an image"):
        load_image((media_dir / "notes.png").as_uri(), allowed_local_media_path=root)


# -- http(s):// ---------------------------------------------------------------------------
PNG = image_bytes(size=(6, 4))


class _Handler(http.server.BaseHTTPRequestHandler):
    """/img.png, /missing (404), /slow (answers after 3 s), /big (says 10 MB),
    /endless (no length, streams until the client leaves), /text (not an image)."""

    def do_GET(self):  # noqa: N802 - http.server's name
        try:
            if self.path == "/img.png":
                self._send(200, PNG)
            elif self.path == "/missing":
                self._send(404, b"nope")
            elif self.path == "/slow":
                time.sleep(3)
                self._send(200, PNG)
            elif self.path == "/big":
                self.send_response(200)
                self.send_header("Content-Length", str(10 << 20))
                self.end_headers()
            elif self.path == "/endless":
                self.send_response(200)
                self.end_headers()
                for _ in range(1000):  # 64 MB at most, if nobody hung up
                    self.wfile.write(b"\0" * 65536)
            elif self.path == "/text":
                self._send(200, b"<html>an error page</html>")
            elif self.path.startswith("/redirect?"):  # to the URL after the "?"
                self.send_response(302)
                self.send_header("Location", self.path.partition("?")[2])
                self.send_header("Content-Length", "0")
                self.end_headers()
        except OSError:
            pass  # the client hung up first

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def server():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    srv.daemon_threads = True
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


def test_http_image(server):
    image = load_image(server + "/img.png", timeout=TIMEOUT)
    assert (image.mode, image.size) == ("RGB", (6, 4))


def test_allowed_media_domains_bound_the_hosts_redirects_included(server):
    port = server.rsplit(":", 1)[1]
    via_localhost = f"{server}/redirect?http://localhost:{port}/img.png"
    allowed = load_image(server + "/img.png", allowed_media_domains=["127.0.0.1"], timeout=TIMEOUT)
    assert allowed.size == (6, 4)
    both = load_image(via_localhost, allowed_media_domains=["LOCALHOST", "127.0.0.1"],
                      timeout=TIMEOUT)  # fmt: skip
    assert both.size == (6, 4)
    for url, domains in (
        (server + "/img.png", ["example.com"]),  # refused before any connection
        (via_localhost, ["127.0.0.1"]),  # the redirect leads elsewhere
        (f"http://[::1]:{port}/img.png", []),
    ):
        with pytest.raises(ValueError, match="is not among --allowed-media-domains"):
            load_image(url, allowed_media_domains=domains, timeout=TIMEOUT)
    # A data URL names no host: the list does not apply to it.
    assert load_image(data_url(PNG), allowed_media_domains=["example.com"]).size == (6, 4)


@pytest.mark.parametrize(
    "path, match",
    [
        ("/missing", "HTTP 404"),
        ("/text", "cannot be decoded as an image"),
        ("/big", "is 10485760 bytes: images are at most 100000 bytes"),
        ("/endless", "images are at most 100000 bytes"),
    ],
)
def test_http_failures_name_the_host(server, path, match):
    start = time.monotonic()
    with pytest.raises(ValueError, match=match) as e:
        load_image(server + path, timeout=TIMEOUT, max_bytes=100_000)
    assert "127.0.0.1" in str(e.value)
    assert time.monotonic() - start < 5


def test_a_slow_server_times_out(server, monkeypatch):
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"127\.0\.0\.1.*no complete response within 0.5 s"):
        load_image(server + "/slow", timeout=TIMEOUT)
    assert time.monotonic() - start < 2.5
    # Unset, the timeout is VLLM_IMAGE_FETCH_TIMEOUT (vLLM's variable).
    monkeypatch.setenv("VLLM_IMAGE_FETCH_TIMEOUT", "0.3")
    start = time.monotonic()
    with pytest.raises(ValueError, match="within 0.3 s"):
        load_image(server + "/slow")
    assert time.monotonic() - start < 2.5


def test_the_timeout_variable_is_checked(monkeypatch):
    from vllm import envs

    monkeypatch.delenv("VLLM_IMAGE_FETCH_TIMEOUT", raising=False)
    assert envs.VLLM_IMAGE_FETCH_TIMEOUT == 5.0  # vLLM's default
    for bad in ("soon", "0", "-1", "nan"):
        monkeypatch.setenv("VLLM_IMAGE_FETCH_TIMEOUT", bad)
        with pytest.raises(ValueError, match="VLLM_IMAGE_FETCH_TIMEOUT"):
            _ = envs.VLLM_IMAGE_FETCH_TIMEOUT


def test_a_refused_connection_names_the_host():
    with socket.socket() as sock:  # a port nobody listens on (bound, never listening)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        with pytest.raises(ValueError, match=r"fetching the image from '127\.0\.0\.1' failed"):
            load_image(f"http://127.0.0.1:{port}/a.png", timeout=TIMEOUT)


def test_the_url_is_not_echoed_whole():
    long_host = "h" * 5000
    with pytest.raises(ValueError, match="fetching the image from 'hhhh") as e:
        load_image(f"http://{long_host}.invalid/a.png", timeout=TIMEOUT)
    assert len(str(e.value)) < 400
