"""The image a request names, loaded (vLLM's ``MediaConnector.fetch_image``).

``load_image(url)`` takes what vLLM's OpenAI server takes in an ``image_url`` part:

- ``data:<media type>;base64,<data>``: the image's bytes inline (the usual form);
- ``http://`` / ``https://``: fetched with the standard library, bounded in time
  (``VLLM_IMAGE_FETCH_TIMEOUT``, 5 s, as vLLM) and in size (``max_bytes``); with
  ``--allowed-media-domains`` (vLLM's flag) only from those hosts, redirects included;
- ``file://``: only a file inside ``--allowed-local-media-path`` (vLLM's flag); without
  the flag every local file is refused.

Every failure is a ``ValueError`` whose message says what went wrong and names the URL by
its scheme and host, or a short cut of it, never by megabytes of base64. Pillow's
decompression-bomb limit (``Image.MAX_IMAGE_PIXELS``) stays on: an image whose header
claims more than twice that many pixels is refused before it is decoded.
"""

from __future__ import annotations

import base64
import binascii
import functools
import http.client
import io
import time
import urllib.error
import urllib.request
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from vllm import envs

if TYPE_CHECKING:
    from PIL import Image

# OpenAI's limit for one image (20 MB). A data URL is bounded earlier by the request body
# (--max-request-body-size); this bounds what a fetch or a file read may bring in.
MAX_IMAGE_BYTES = 20 << 20
_READ_CHUNK = 1 << 16
_SHOWN_CHARS = 64
# What transparent pixels become in RGB: white, as vLLM's ``rgba_to_rgb``.
_BACKGROUND = (255, 255, 255)
_USER_AGENT = "vllm-continuum"


def load_image(
    url: str,
    *,
    allowed_local_media_path: str | None = None,
    allowed_media_domains: Collection[str] | None = None,
    timeout: float | None = None,
    max_bytes: int = MAX_IMAGE_BYTES,
) -> Image.Image:
    """The image ``url`` names, in RGB. ``timeout``: seconds an http(s) fetch may take
    (None: ``VLLM_IMAGE_FETCH_TIMEOUT``); ``max_bytes``: the largest encoded image taken;
    ``allowed_media_domains``: the hosts an http(s) image may come from, after any
    redirect (None: any). Blocking (network, disk, decoding): call it off the event
    loop."""
    if not isinstance(url, str):
        raise ValueError(f"an image URL must be a string, got {type(url).__name__}")
    scheme = url.partition(":")[0].lower() if ":" in url else ""
    if scheme == "data":
        return decode_image(_data_url_bytes(url, max_bytes), "the image data URL")
    if scheme in ("http", "https"):
        if timeout is None:
            timeout = envs.VLLM_IMAGE_FETCH_TIMEOUT
        domains = None
        if allowed_media_domains is not None:
            domains = frozenset(d.lower() for d in allowed_media_domains)
            _check_host(url, domains)
        data = _fetch(url, timeout, max_bytes, domains)
        return decode_image(data, f"the image from {_host(url)}")
    if scheme == "file":
        path, data = _read_file(url, allowed_local_media_path, max_bytes)
        return decode_image(data, f"the image file {shorten(str(path))}")
    raise ValueError(f"image URL {shorten(url)} is not a data:, http://, https:// or file:// URL")


def shorten(text: str, limit: int = _SHOWN_CHARS) -> str:
    """``text`` for an error message: repr-escaped, at most ``limit`` characters of it."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} chars)"


def _host(url: str) -> str:
    try:
        host = urlsplit(url).hostname
    except ValueError:  # a malformed netloc ("http://[::1")
        host = None
    return shorten(host, 80) if host else "a URL without a host"


class _Refused(ValueError):
    """An image this module refuses (too large, a host not allowed), as opposed to a
    failure to get it."""


def _too_large(what: str, size: int | str, max_bytes: int) -> _Refused:
    return _Refused(f"{what} is {size} bytes: images are at most {max_bytes} bytes")


def _data_url_bytes(url: str, max_bytes: int) -> bytes:
    """The bytes of ``data:[<media type>][;base64],<data>``. Only base64 is taken, as in
    vLLM; the media type is not checked (vLLM ignores it too): the bytes say the format."""
    header, comma, payload = url[len("data:") :].partition(",")
    if not comma:
        raise ValueError(f"image data URL {shorten(url)} has no ',' before its data")
    if "base64" not in (p.strip().lower() for p in header.split(";")[1:]):
        raise ValueError(
            f"image data URL {shorten(header)}: only base64 data URLs are supported "
            "(data:image/<format>;base64,<data>)"
        )
    if len(payload) // 4 * 3 > max_bytes:  # refused before decoding any of it
        raise _too_large("the image data URL's data", len(payload) // 4 * 3, max_bytes)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:  # ValueError: non-ASCII characters
        raise ValueError(
            f"image data URL {shorten(header)}: its data ({len(payload)} chars) is not "
            f"valid base64: {e}"
        ) from None


def _check_host(url: str, domains: frozenset[str]) -> None:
    """``ValueError`` unless ``url``'s host is one of ``domains`` (lower case)."""
    try:
        host = (urlsplit(url).hostname or "").lower()
    except ValueError:
        host = ""
    if host not in domains:
        raise _Refused(
            f"image URL {shorten(url)}: its host {host or '(none)'!r} is not among "
            "--allowed-media-domains"
        )


class _RedirectWithin(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only to one of the allowed hosts."""

    def __init__(self, domains: frozenset[str]) -> None:
        self.domains = domains

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        _check_host(newurl, self.domains)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _fetch(
    url: str, timeout: float, max_bytes: int, domains: frozenset[str] | None = None
) -> bytes:
    """The body of ``url``, read within about ``timeout`` seconds in all (each socket
    operation is bounded by it, and the read stops once the deadline has passed);
    ``domains``: the hosts a redirect may lead to (None: any)."""
    where = f"fetching the image from {_host(url)} failed"
    request = urllib.request.Request(url, headers={"User-Agent": _USER_AGENT})
    handlers = [] if domains is None else [_RedirectWithin(domains)]
    try:
        with urllib.request.build_opener(*handlers).open(request, timeout=timeout) as response:
            return _read_body(response, time.monotonic() + timeout, max_bytes, where)
    except _Refused:
        raise
    except urllib.error.HTTPError as e:
        raise ValueError(f"{where}: HTTP {e.code} {shorten(str(e.reason), 80)}") from None
    except urllib.error.URLError as e:
        raise ValueError(f"{where}: {_reason(e.reason, timeout)}") from None
    # OSError: timeouts, resets; HTTPException: malformed responses; ValueError: a URL
    # urllib cannot use (a bad port, a host name IDNA cannot encode).
    except (OSError, http.client.HTTPException, ValueError) as e:
        raise ValueError(f"{where}: {_reason(e, timeout)}") from None


def _read_body(response, deadline: float, max_bytes: int, where: str) -> bytes:
    length = response.headers.get("Content-Length", "")
    if length.isdigit() and int(length) > max_bytes:
        raise _too_large(where + ": the response", int(length), max_bytes)
    chunks, size = [], 0
    while chunk := response.read1(_READ_CHUNK):
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(where + ": the response", f"over {max_bytes}", max_bytes)
        if time.monotonic() > deadline:
            raise TimeoutError("timed out")
        chunks.append(chunk)
    return b"".join(chunks)


def _reason(error: object, timeout: float) -> str:
    if isinstance(error, TimeoutError):
        return f"no complete response within {timeout:g} s (VLLM_IMAGE_FETCH_TIMEOUT)"
    return shorten(str(error) or type(error).__name__, 120)


def _read_file(url: str, allowed: str | None, max_bytes: int) -> tuple[Path, bytes]:
    """The path and bytes of a ``file://`` URL that resolves (symbolic links followed)
    to a file under ``allowed``."""
    if allowed is None:
        raise ValueError(
            "file:// image URLs are refused: start the server with "
            "--allowed-local-media-path DIR to let requests read images under DIR"
        )
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise ValueError(
            f"file URL {shorten(url)} names the host {shorten(parts.netloc)}: only local "
            "files (file:///path) can be read"
        )
    path = Path(urllib.request.url2pathname(parts.path))
    resolved = path.resolve()
    root = Path(allowed).resolve()
    if root not in resolved.parents:
        raise ValueError(
            f"the file {shorten(str(path))} is not inside --allowed-local-media-path {allowed}"
        )
    try:
        with open(resolved, "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as e:
        raise ValueError(
            f"the image file {shorten(str(path))} cannot be read: {e.strerror or e}"
        ) from None
    if len(data) > max_bytes:
        raise _too_large(f"the image file {shorten(str(path))}", f"over {max_bytes}", max_bytes)
    return path, data


def decode_image(data: bytes, source: str) -> Image.Image:
    """``data`` (a PNG, JPEG, ... file's bytes) decoded and converted to RGB; a
    ``ValueError`` naming ``source`` if Pillow cannot decode it, or if its size passes
    Pillow's decompression-bomb limit."""
    from PIL import Image

    try:
        image = Image.open(io.BytesIO(data))
        image.load()
        return _to_rgb(image)
    except Image.DecompressionBombError as e:
        raise ValueError(f"{source} is too large to decode: {e}") from None
    except Exception as e:  # noqa: BLE001 - any decoder failure is the input's fault
        raise ValueError(
            f"{source} ({len(data)} bytes) cannot be decoded as an image: "
            f"{shorten(str(e) or type(e).__name__, 120)}"
        ) from None


def _to_rgb(image: Image.Image) -> Image.Image:
    from PIL import Image

    if image.mode == "RGB":
        return image
    transparent = image.mode in ("RGBA", "LA", "PA", "RGBa", "La") or (
        image.mode == "P" and "transparency" in image.info
    )
    if not transparent:
        return image.convert("RGB")
    rgba = image.convert("RGBA")
    out = Image.new("RGB", image.size, _BACKGROUND)
    out.paste(rgba, mask=rgba.getchannel("A"))
    return out


@functools.lru_cache(maxsize=32)
def template_reads_parts(template: str) -> bool:
    """Whether ``template`` loops over a message's content (``for c in message['content']``
    or ``message.content``, filters such as ``| selectattr(...)`` allowed): vLLM's "auto"
    content format then gives it typed parts ("openai"), else text ("string"). A
    template jinja cannot parse here is taken as reading text."""
    import jinja2
    from jinja2 import nodes

    try:
        tree = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateError:
        return False
    for loop in tree.find_all(nodes.For):
        source = loop.iter
        while isinstance(source, nodes.Filter | nodes.Test):
            source = source.node
        if isinstance(source, nodes.Getattr) and source.attr == "content":
            return True
        if isinstance(source, nodes.Getitem) and isinstance(source.arg, nodes.Const):
            if source.arg.value == "content":
                return True
    return False
