"""``FrontendArgs``: the settings of the HTTP server in front of the engine (``vllm serve``).

Like the engine's configs, each knob is declared once, as a ``config_field`` carrying its
help and flag; ``add_cli_args`` generates the flags from the fields. Only argparse and the
config modules are imported here: ``vllm serve --help`` must stay instant.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import dataclass, fields
from typing import Any, Literal, get_type_hints

from vllm.config import config_field, parse_bytes
from vllm.engine.arg_utils import ConfigArg

KiB = 1 << 10
MiB = 1 << 20
UvicornLogLevel = Literal["critical", "error", "warning", "info", "debug", "trace"]
LogLevel = Literal["critical", "error", "warning", "info", "debug"]


def parse_str_list(text: str) -> list[str]:
    """One value of a list flag: a JSON list of strings (vLLM's form, ``'["*"]'``) or one
    bare string."""
    if not text.lstrip().startswith("["):
        return [text]
    try:
        values = json.loads(text)
    except ValueError:
        raise ValueError(f"expected a JSON list of strings, got {text!r}") from None
    if not all(isinstance(v, str) for v in values):
        raise ValueError(f"expected a JSON list of strings, got {text!r}")
    return values


def parse_json_object(text: str) -> dict[str, Any]:
    """A JSON object flag, e.g. ``'{"enable_thinking": false}'``."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, got {text!r}")
    return value


def parse_size(text: str | int) -> int:
    """'8MiB', '512KiB' or an integer -> bytes (ValueError naming what a size looks like)."""
    try:
        return parse_bytes(text)
    except ValueError:
        raise ValueError(f"expected a size like 8MiB or 1048576, got {text!r}") from None


@dataclass(frozen=True)
class FrontendArgs:
    """Settings of the HTTP server (not the engine): binding, auth, logging, the limits
    that protect it from one client, health and shutdown."""

    host: str = config_field("127.0.0.1", "Host to bind.")
    port: int = config_field(8000, "Port to bind.")
    uds: str | None = config_field(
        None,
        "Serve on this Unix domain socket path instead of --host/--port (vLLM's); a stale "
        "socket file left by a killed server is replaced, a live one refused.",
    )
    api_key: str | None = config_field(None, "Require this key as a Bearer token on /v1.")
    ssl_keyfile: str | None = config_field(None, "Serve HTTPS with this private key file (PEM).")
    ssl_certfile: str | None = config_field(
        None, "Serve HTTPS with this certificate file (PEM; with --ssl-keyfile)."
    )
    ssl_ca_certs: str | None = config_field(
        None, "CA certificates to check client certificates against (with --ssl-cert-reqs)."
    )
    ssl_cert_reqs: int = config_field(
        0,
        "Client certificates (Python's ssl.VerifyMode): 0 not asked, 1 checked if given, "
        "2 required.",
        choices=(0, 1, 2),
    )
    ssl_ciphers: str | None = config_field(
        None,
        "The cipher suites HTTPS offers (vLLM's; uvicorn's ssl_ciphers, an OpenSSL cipher "
        "list such as 'ECDHE-RSA-AES256-GCM-SHA384:ECDHE-RSA-CHACHA20-POLY1305'). Applies "
        "to TLS 1.2 and below: TLS 1.3's suites are OpenSSL's. Checked at start.",
    )
    root_path: str | None = config_field(
        None,
        "The path prefix a path-routing proxy serves this server under (FastAPI's "
        "root_path, e.g. /llm): routes answer with or without it, and the API docs' URLs "
        "carry it.",
    )
    allowed_origins: tuple[str, ...] = config_field(
        ("*",),
        "CORS: the origins a web page may call the server from (vLLM's flag; a JSON list or "
        "values; default any). The API key is still required where it is set.",
        parse=parse_str_list,
    )
    allowed_methods: tuple[str, ...] = config_field(
        ("*",), "CORS: the methods a web page may use (a JSON list or values).",
        parse=parse_str_list,
    )  # fmt: skip
    allowed_headers: tuple[str, ...] = config_field(
        ("*",), "CORS: the request headers a web page may send (a JSON list or values).",
        parse=parse_str_list,
    )  # fmt: skip
    allow_credentials: bool = config_field(
        False, "CORS: let web pages send credentials (cookies, HTTP auth) with their calls."
    )
    enable_request_id_headers: bool = config_field(
        False,
        "Put an X-Request-Id header on every response: the request's own, or a new one.",
    )
    middleware: list[str] | None = config_field(
        None,
        "ASGI middleware to add to the app, by import path (pkg.module.Name); repeat the "
        "flag (vLLM's form) or give several. A class is added with "
        "app.add_middleware(Class), an async function (request, call_next) as "
        "@app.middleware('http'); they wrap the server's own middleware (CORS, the API "
        "key), the last given outermost. Imported at start: one that cannot be is an error.",
    )
    disable_uvicorn_access_log: bool = config_field(
        False, "No access log line per HTTP request (the request log stays)."
    )
    disable_access_log_for_endpoints: str | None = config_field(
        None,
        "Paths whose requests get no access log line (vLLM's; comma-separated, e.g. "
        "/health,/metrics,/ping): a path matches exactly, without its query string and "
        "with or without --root-path. Other requests are logged as before.",
    )
    disable_fastapi_docs: bool = config_field(
        False, "Serve no OpenAPI schema (/openapi.json) and no docs pages (/docs, /redoc)."
    )
    enable_offline_docs: bool = config_field(
        False,
        "vLLM's: serve the /docs and /redoc pages with their scripts bundled, for machines "
        "without internet. Only off is accepted: the pages load Swagger UI and ReDoc from a "
        "CDN (FastAPI's), and no copy of them ships here.",
    )
    enable_ssl_refresh: bool = config_field(
        False,
        "vLLM's: reload the certificate and key when their files change. Only off is "
        "accepted: they are read once, at start; restart the server to change them.",
    )
    enable_per_request_metrics: bool = config_field(
        False,
        "vLLM's per-request timings in each completion's response. Only off is accepted: "
        "responses carry no timings (they are in the metrics and the trace spans).",
    )
    grpc: bool = config_field(
        False,
        "vLLM's: serve gRPC instead of HTTP. Refused: this engine has no gRPC server.",
    )
    default_chat_template_kwargs: dict[str, Any] | None = config_field(
        None,
        "Chat template variables every chat request gets unless it sets them itself in "
        "chat_template_kwargs (a JSON object, e.g. '{\"enable_thinking\": false}').",
        parse=parse_json_object,
    )
    enable_force_include_usage: bool = config_field(
        False,
        "Every streamed response ends with a usage chunk, as if it asked for "
        "stream_options.include_usage.",
    )
    sse_keep_alive_interval: float = config_field(
        0.0,
        "Seconds a stream may go without sending anything before the server sends an SSE "
        "comment line (': keep-alive'; vLLM's), so a proxy with a read timeout does not "
        "cut a request that waits in the queue or a long prefill; 0: off. On every "
        "streaming route (chat, completions, responses, /inference/v1/generate); "
        "/v1/messages sends Anthropic's ping event at this interval instead (10 s unset).",
    )
    enable_prompt_tokens_details: bool = config_field(
        False,
        "vLLM's: usage carries prompt_tokens_details (cached_tokens: the prompt tokens "
        "read from the prefix cache). Here it always does, with or without the flag.",
    )
    return_tokens_as_token_ids: bool = config_field(
        False,
        "Logprobs name their tokens 'token_id:<id>' (tokens JSON cannot hold, such as a "
        "partial UTF-8 character, stay identifiable); a request's "
        "return_tokens_as_token_ids overrides it.",
    )
    disable_log_requests: bool = config_field(
        False, "Do not log each request (nor the engine's per-job lines)."
    )
    enable_log_requests: bool = config_field(
        False,
        "Log each engine request as it is added (vLLM's): its id, sampling parameters and "
        "LoRA adapter at INFO; its prompt and prompt token ids at DEBUG (--log-level "
        "debug), cut to --max-log-len.",
    )
    enable_log_outputs: bool = config_field(
        False,
        "Log each request's output when it finishes (vLLM's): its text and finish reason "
        "at INFO, its token ids at DEBUG, cut to --max-log-len; a stream's deltas too, "
        "unless --no-enable-log-deltas.",
    )
    enable_log_deltas: bool = config_field(
        True,
        "With --enable-log-outputs, log each streamed delta, not only the complete output.",
    )
    max_log_len: int | None = config_field(
        None,
        "Most characters of a prompt or output, and most token ids, that the request and "
        "output logs print (unset: all).",
    )
    log_level: LogLevel | None = config_field(
        None,
        "Level of this server's and its engine's logs (vLLM's; the default is info, or "
        "VLLM_LOGGING_LEVEL).",
    )
    log_error_stack: bool = config_field(
        False,
        "Log the stack trace of each error response's exception (vLLM's; also with "
        "VLLM_SERVER_DEV_MODE=1): 4xx and 5xx alike, with the route and request id.",
    )
    enable_tokenizer_info_endpoint: bool = config_field(
        False,
        "Serve GET /tokenizer_info (vLLM's): the tokenizer's configuration, class and the "
        "chat template, for clients that tokenize themselves. Off by default: it shows "
        "how the server renders prompts.",
    )
    enable_server_load_tracking: bool = config_field(
        False,
        "Count the requests in flight on the routes that run the model (chat, completions, "
        "responses, messages, embeddings, score, rerank, invocations, /inference/v1/generate), "
        "from arrival to the "
        "end of the response, and serve the count at GET /load (vLLM's); off: /load "
        "answers 0.",
    )
    enable_scale_out: bool = config_field(
        False,
        "Serve vLLM's scale-out routes: POST /inference/v1/generate (tokens in, tokens "
        "out), /inference/v1/abort_requests, and /v1/completions/render, "
        "/v1/messages/render and /v1/responses/render (the generate body a request would "
        "run as), /v1/chat/completions/derender and /v1/completions/derender (its output "
        "read back as those routes would); off: they answer 403. "
        "/v1/chat/completions/render is always served (vllm-router's cache_aware needs it).",
    )
    tokens_only: bool = config_field(
        False,
        "vLLM's tokens-in/tokens-out server (a disaggregated deployment's worker): no "
        "tokenizer is loaded (--skip-tokenizer-init), the scale-out routes are served "
        "(as --enable-scale-out), /inference/v1/generate detokenizes nothing and refuses "
        "stop strings (use stop_token_ids), and POST /abort_requests (vLLM's legacy path) "
        "aborts as /inference/v1/abort_requests does. Text routes refuse text prompts.",
    )
    disable_log_stats: bool = config_field(
        False,
        "Do not log the throughput line (prompt and generation tokens/s, queues, KV cache "
        "usage, prefix cache hit rate) every VLLM_LOG_STATS_INTERVAL seconds (10).",
    )
    uvicorn_log_level: UvicornLogLevel = config_field("info", "Log level of uvicorn.")
    log_config_file: str | None = config_field(
        None,
        'A JSON logging configuration (logging.config.dictConfig\'s schema, "version": 1) '
        "given to uvicorn, as vLLM's: it configures the loggers it names in the API server "
        "(uvicorn's, vllm's) when the server starts; --uvicorn-log-level still sets "
        "uvicorn's levels. Read at start: a file that is not such JSON is an error.",
    )
    trust_request_chat_template: bool = config_field(
        False,
        "Accept a request's own chat_template. Off: a request carrying one is refused (400), "
        "since a template is code the server runs for the client.",
    )
    chat_template_content_format: Literal["auto", "string", "openai"] = config_field(
        "auto",
        "How chat templates get a message's content (vLLM's flag): string, as text (an "
        "image part becomes the model's placeholder, e.g. '<image>', before the text); "
        "openai, as typed parts ([{'type': 'text', 'text': ...}, {'type': 'image'}]) for "
        "templates that write image placeholders themselves; auto, openai for a request "
        "with images when the template loops over a message's content, else string.",
    )
    allowed_local_media_path: str | None = config_field(
        None,
        "A directory whose files chat requests may name as images (file:///... URLs in "
        "image_url parts; vLLM's flag). Unset: every file:// URL is refused. Symbolic "
        "links are followed first: the file they lead to must be inside too.",
    )
    allowed_media_domains: tuple[str, ...] | None = config_field(
        None,
        "The hosts whose http(s) images chat requests may name (vLLM's flag; a JSON list or "
        "values, e.g. upload.wikimedia.org github.com). Unset: any host. A redirect to a "
        "host not listed is refused too; data: URLs are not fetched and need no host.",
        parse=parse_str_list,
    )
    max_request_body_size: int = config_field(
        8 * MiB,
        "Largest request body accepted, in bytes (8MiB, 512KiB, ...); a larger one is a 413.",
        parse=parse_size,
    )
    max_request_header_size: int = config_field(
        64 * KiB,
        "Largest request head (request line and headers), in bytes; a larger one is a 431 "
        "and the connection closes. vLLM's h11 limit is 4MiB; nginx's default is 32KiB. "
        "--h11-max-incomplete-event-size (vLLM's name: h11 buffers at most that much of an "
        "unfinished head) sets it too.",
        parse=parse_size,
        aliases=("--h11-max-incomplete-event-size",),
    )
    max_request_header_count: int = config_field(
        256,
        "Most header fields one request may carry (431 beyond; vLLM's h11 limit, which "
        "--h11-max-header-count, vLLM's name, sets too).",
        aliases=("--h11-max-header-count",),
    )
    max_n_sequences: int = config_field(
        128, "Largest n (completions per request) accepted (vLLM: VLLM_MAX_N_SEQUENCES)."
    )
    max_stop_strings: int = config_field(32, "Most stop strings one request may give.")
    max_stop_string_length: int = config_field(512, "Longest stop string accepted, characters.")
    max_job_id_length: int = config_field(256, "Longest job_id accepted, characters.")
    request_read_timeout: float = config_field(
        30.0,
        "Seconds a connection has to deliver a whole request (headers and body) once it opens "
        "or its previous response ends; then it is closed. Bounds half-open connections.",
    )
    engine_stall_timeout: float = config_field(
        60.0,
        "/health answers 503 when requests are pending and the engine sent nothing for this "
        "many seconds (a hung engine process).",
    )
    shutdown_timeout: float = config_field(
        20.0,
        "On SIGTERM/SIGINT: seconds running requests get to finish (new ones get 503), "
        "after which they end with an error. 0: end them at once. A second signal ends the "
        "wait.",
    )
    enable_auto_tool_choice: bool = config_field(
        False,
        'Let the model decide when to call tools (tool_choice "auto"); needs --tool-call-parser.',
    )
    tool_call_parser: str | None = config_field(
        None,
        "How the model writes tool calls (hermes: <tool_call>{json}</tool_call>; json / "
        "llama3_json: the output is the JSON call or a list of them; granite: that list "
        "after <|tool_call|> or <tool_call>; mistral: [TOOL_CALLS]name[ARGS]{json}; "
        "qwen3_coder / qwen3_xml: "
        "<tool_call><function=NAME><parameter=KEY>...).",
        choices=lambda: _tool_parser_names(),
    )
    tool_parser_plugin: str | None = config_field(
        None,
        "A Python file (or module name) whose import registers more tool parsers "
        '(@register_tool_parser("name")); --tool-call-parser can then name them (vLLM\'s).',
    )
    tool_strict_level: Literal["auto", "function", "parameter"] = config_field(
        "auto",
        'What tool_choice "auto" holds to its form once the model opens a call (vLLM\'s '
        'flag). auto: nothing, unless a tool says "strict": true; then every call names a '
        "tool and a strict tool's arguments match its schema. function: every call names "
        "a tool. parameter: every tool's arguments match its schema too. Needs a "
        "--tool-call-parser with a structural tag (hermes); others stay free, as in vLLM.",
    )
    exclude_tools_when_tool_choice_none: bool = config_field(
        False,
        'A request with tool_choice "none" renders no tools in its prompt (vLLM\'s flag); '
        "by default the template still sees them, only the output is not read as calls.",
    )
    tool_server: str | None = config_field(
        None,
        "Comma-separated MCP servers whose tools the Responses API's mcp tools may use: "
        "host:port (vLLM's form: SSE at http://host:port/sse; IPv6 as [::1]:8000) or "
        "http(s) URLs (a path ending in /sse: SSE, else streamable HTTP). Each is "
        "connected at start-up and labelled by its own name; the server reaches no other "
        "MCP server. vLLM's built-in 'demo' tools are not built here.",
    )
    response_role: str = config_field(
        "assistant", "The role chat replies name (vLLM's flag; their message.role)."
    )
    reasoning_parser: str | None = config_field(
        None,
        "Split a thinking model's reasoning (<think>...</think>) from its answer: chat "
        "returns it as message.reasoning, the content and tool calls are read from the rest "
        "(qwen3, deepseek_r1).",
        choices=lambda: _reasoning_parser_names(),
    )
    reasoning_parser_plugin: str | None = config_field(
        None,
        "A Python file (or module name) whose import registers more reasoning parsers "
        '(@register_reasoning_parser("name")); --reasoning-parser can then name them.',
    )
    structured_outputs_config: dict[str, Any] | None = config_field(
        None,
        "JSON object, vLLM's StructuredOutputsConfig as far as this server goes: its "
        "structured outputs are llguidance's (vLLM's guidance backend). backend: auto or "
        "guidance; disable_fallback: true or false (one backend, nothing to fall back to); "
        "disable_additional_properties: true (object schemas are always strict here: no "
        "property they do not name); disable_any_whitespace: false (JSON gets json.dumps' "
        "', ' and ': ' and no other whitespace); enable_in_reasoning: false (with a "
        "reasoning parser the grammar starts after the reasoning); reasoning_parser: as "
        "--reasoning-parser. Other backends, values and keys are refused.",
        parse=parse_json_object,
    )
    lora_modules: tuple[Any, ...] | None = config_field(
        None,
        "LoRA adapters to serve (with --enable-lora), each under its own model name: "
        'name=path, or JSON {"name": ..., "path": ..., "base_model_name": ...}.',
        parse=lambda text: _parse_lora_module(text),
    )
    api_server_count: int | None = config_field(
        None,
        "API server processes in front of the engine, each with its own event loop, "
        "sharing the port (vLLM's flag): one process spends tens of microseconds of CPU "
        "per streamed token, so many concurrent streams can outrun it. Metrics and stored "
        "responses are shared; any process's death stops the server. Unset: 1, or the "
        "--data-parallel-size (as in vLLM).",
        aliases=("-asc",),
    )
    keep_alive_on_engine_death: bool = config_field(
        False,
        "Keep the API server up (answering 503/500) when the engine process died, instead of "
        "exiting with status 1 so a supervisor restarts it (vLLM: "
        "VLLM_KEEP_ALIVE_ON_ENGINE_DEATH).",
    )

    def __post_init__(self) -> None:
        for name in (
            "allowed_origins",
            "allowed_methods",
            "allowed_headers",
            "allowed_media_domains",
        ):
            values = getattr(self, name)  # a flag's values: each a list, or one string
            if values is None:  # allowed_media_domains unset: any host
                continue
            if isinstance(values, str):
                raise ValueError(f"{name} must be a list of strings, got {values!r}")
            flat = [v for item in values for v in (item if isinstance(item, list) else [item])]
            if not all(isinstance(v, str) for v in flat):
                raise ValueError(f"{name} must be strings, got {values!r}")
            object.__setattr__(self, name, tuple(flat))
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("ssl_keyfile and ssl_certfile go together: give both or neither")
        for name in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"{name}: no such file: {path!r}")
        if not isinstance(self.response_role, str) or not self.response_role:
            raise ValueError(f"response_role must be a non-empty name, got {self.response_role!r}")
        if self.ssl_cert_reqs not in (0, 1, 2):
            raise ValueError(f"ssl_cert_reqs must be 0, 1 or 2, got {self.ssl_cert_reqs!r}")
        if self.ssl_cert_reqs and self.ssl_keyfile is None:
            raise ValueError("ssl_cert_reqs asks for client certificates: it needs HTTPS")
        if self.ssl_ciphers is not None:
            _check_ssl_ciphers(self.ssl_ciphers, self.ssl_keyfile is not None)
        if self.disable_access_log_for_endpoints is not None:
            self.access_log_excluded_paths()  # ValueError now
        value = self.sse_keep_alive_interval
        if isinstance(value, bool) or not (math.isfinite(value) and value >= 0):
            raise ValueError(f"sse_keep_alive_interval must be >= 0 seconds, got {value!r}")
        if self.tokens_only:
            self._check_tokens_only()
            object.__setattr__(self, "enable_scale_out", True)  # its routes are the point
        root = self.root_path
        if root is not None and (not root.startswith("/") or root.endswith("/")):
            raise ValueError(f"root_path must start with / and not end with one, got {root!r}")
        if self.default_chat_template_kwargs is not None:
            from vllm.entrypoints.openai.protocol import RESERVED_TEMPLATE_VARIABLES

            reserved = sorted(set(self.default_chat_template_kwargs) & RESERVED_TEMPLATE_VARIABLES)
            if reserved:
                raise ValueError(
                    f"default_chat_template_kwargs may not set {', '.join(reserved)}: they "
                    "are request fields of their own"
                )
        media = self.allowed_local_media_path
        if media is not None and not os.path.isdir(media):
            raise ValueError(f"allowed_local_media_path: no such directory: {media!r}")
        if self.lora_modules is not None:
            modules = [_parse_lora_module(m) if isinstance(m, str) else m
                       for m in self.lora_modules]  # fmt: skip
            object.__setattr__(self, "lora_modules", tuple(modules))
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        positive = (
            "max_request_body_size",
            "max_request_header_size",
            "max_request_header_count",
            "max_n_sequences",
            "max_stop_string_length",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        count = self.api_server_count
        if count is not None and (isinstance(count, bool) or count < 1):
            raise ValueError(f"api_server_count must be at least 1, got {count}")
        if self.max_log_len is not None and self.max_log_len < 0:
            raise ValueError(f"max_log_len must be >= 0, got {self.max_log_len}")
        for name in ("max_stop_strings", "max_job_id_length"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("request_read_timeout", "engine_stall_timeout"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number of seconds, got {value}")
        if not (math.isfinite(self.shutdown_timeout) and self.shutdown_timeout >= 0):
            raise ValueError(f"shutdown_timeout must be >= 0 seconds, got {self.shutdown_timeout}")
        for path in self.middleware or ():
            resolve_middleware(path)  # ValueError now, not once the model is loaded
        if self.log_config_file is not None:
            load_log_config(self.log_config_file)
        if self.structured_outputs_config is not None:
            self._fold_structured_outputs_config()
        self._check_vllm_off_flags()

    def _check_vllm_off_flags(self) -> None:
        """vLLM's front-end flags that ask for what this server does not have: off only."""
        refusals = {
            "enable_offline_docs": "the /docs and /redoc pages load Swagger UI and ReDoc "
            "from a CDN (FastAPI's) and no bundled copy ships here (--disable-fastapi-docs "
            "turns the pages off)",
            "enable_ssl_refresh": "the certificate and key are read once, at start; restart "
            "the server to load new ones",
            "enable_per_request_metrics": "responses carry no per-request timings (they are in "
            "the metrics at /metrics and the trace spans)",
            "grpc": "this engine has no gRPC server, only the HTTP OpenAI-compatible one",
        }
        for name, why in refusals.items():
            if getattr(self, name):
                raise ValueError(f"{name} must be off: {why}, got True")

    def access_log_excluded_paths(self) -> frozenset[str]:
        """--disable-access-log-for-endpoints's paths (ValueError for one without a /)."""
        text = self.disable_access_log_for_endpoints or ""
        paths = frozenset(p.strip() for p in text.split(",") if p.strip())
        bad = sorted(p for p in paths if not p.startswith("/"))
        if bad:
            raise ValueError(
                f"disable_access_log_for_endpoints must be comma-separated paths starting "
                f"with /, e.g. /health,/metrics; got {bad}"
            )
        return paths

    def _check_tokens_only(self) -> None:
        """--tokens-only loads no tokenizer: the flags that need one are refused."""
        text_flags = {
            "reasoning_parser": "--reasoning-parser",
            "tool_call_parser": "--tool-call-parser",
            "enable_auto_tool_choice": "--enable-auto-tool-choice",
            "enable_tokenizer_info_endpoint": "--enable-tokenizer-info-endpoint",
            "default_chat_template_kwargs": "--default-chat-template-kwargs",
        }
        given = [flag for name, flag in text_flags.items() if getattr(self, name)]
        if given:
            raise ValueError(
                f"--tokens-only loads no tokenizer and serves token ids only: "
                f"{', '.join(given)} cannot be used with it"
            )

    def _fold_structured_outputs_config(self) -> None:
        """Check --structured-outputs-config; its reasoning_parser becomes --reasoning-parser
        (ValueError when both are given and differ)."""
        spec = self.structured_outputs_config
        if not isinstance(spec, dict):
            raise ValueError(f"structured_outputs_config must be a JSON object, got {spec!r}")
        keys = (*STRUCTURED_OUTPUTS_VALUES, "reasoning_parser")
        unknown = sorted(set(spec) - set(keys))
        if unknown:
            raise ValueError(
                f"structured_outputs_config has keys this server does not take: {unknown}; "
                f"it takes {list(keys)}"
            )
        for key, (allowed, why) in STRUCTURED_OUTPUTS_VALUES.items():
            value = spec.get(key, allowed[0])  # (type: True is not 1)
            if not any(type(value) is type(a) and value == a for a in allowed):
                raise ValueError(f"structured_outputs_config.{key} {why}, got {value!r}")
        parser = spec.get("reasoning_parser") or None  # vLLM's "" is unset
        if parser is None:
            return
        if self.reasoning_parser is not None and self.reasoning_parser != parser:
            raise ValueError(
                f"--reasoning-parser {self.reasoning_parser!r} and "
                f"structured_outputs_config.reasoning_parser {parser!r} disagree: give one"
            )
        if parser not in _reasoning_parser_names():
            raise ValueError(
                f"structured_outputs_config.reasoning_parser must be one of "
                f"{list(_reasoning_parser_names())}, got {parser!r}"
            )
        object.__setattr__(self, "reasoning_parser", parser)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """The flags, in one help group ("server")."""
        group = parser.add_argument_group("server", FrontendArgs.__doc__)
        for arg in frontend_args():
            group.add_argument(arg.flag, *arg.aliases, **arg.argparse_kwargs())
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> FrontendArgs:
        """Validated settings (ValueError naming the field) from parsed flags."""
        values: dict[str, Any] = {}
        for arg in frontend_args():
            value = getattr(args, arg.dest)
            if arg.parse is not None and isinstance(value, str):
                value = arg.parse(value)
            values[arg.field] = value
        return cls(**values)


# --structured-outputs-config's keys (vLLM's) with the values this server honours and why
# others are refused.
STRUCTURED_OUTPUTS_VALUES: dict[str, tuple[tuple[Any, ...], str]] = {
    "backend": (
        ("auto", "guidance"),
        "must be auto or guidance: structured outputs here are llguidance's (vLLM's guidance "
        "backend); xgrammar, outlines and lm-format-enforcer are not used",
    ),
    "disable_fallback": ((False, True), "must be true or false"),
    "disable_any_whitespace": (
        (False,),
        "must be false: JSON here has json.dumps' whitespace (', ' and ': ') and no other; "
        "JSON without any whitespace is not implemented",
    ),
    "disable_additional_properties": (
        (True,),
        "must be true: object schemas are always strict here (no property they do not name)",
    ),
    "enable_in_reasoning": (
        (False,),
        "must be false: with a reasoning parser the grammar starts after the reasoning; "
        "constraining the reasoning itself is not implemented",
    ),
}


def _check_ssl_ciphers(ciphers: str, https: bool) -> None:
    """--ssl-ciphers: only with HTTPS, and a cipher list OpenSSL knows (ValueError)."""
    import ssl

    if not https:
        raise ValueError("--ssl-ciphers needs HTTPS (--ssl-keyfile and --ssl-certfile)")
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).set_ciphers(ciphers)
    except ssl.SSLError:
        raise ValueError(
            f"--ssl-ciphers {ciphers!r} names no cipher suite OpenSSL has (e.g. "
            "'ECDHE-RSA-AES256-GCM-SHA384:ECDHE-RSA-CHACHA20-POLY1305')"
        ) from None


def resolve_middleware(path: str) -> Any:
    """--middleware's object: ``pkg.module.Name`` (or ``pkg.module:Name``) imported, which
    must be a class or an async function; ValueError naming the flag otherwise."""
    import importlib
    import inspect

    module_name, _, name = path.rpartition(":" if ":" in path else ".")
    if not module_name or not name:
        raise ValueError(f"--middleware {path!r} must be an import path, e.g. pkg.module.Name")
    try:
        obj = getattr(importlib.import_module(module_name), name)
    except Exception as e:  # any error of the user's module: report it, at start
        raise ValueError(f"--middleware {path!r} cannot be imported: {e!r}") from None
    if not (inspect.isclass(obj) or inspect.iscoroutinefunction(obj)):
        raise ValueError(
            f"--middleware {path!r} must be an ASGI middleware class or an async function "
            "(request, call_next)"
        )
    return obj


def load_log_config(path: str) -> dict[str, Any]:
    """--log-config-file's configuration: a JSON object in ``logging.config.dictConfig``'s
    schema (ValueError naming the flag when the file cannot be read or is not one)."""
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except OSError as e:
        raise ValueError(f"--log-config-file {path!r} cannot be read: {e.strerror}") from None
    except ValueError as e:
        raise ValueError(f"--log-config-file {path!r} is not JSON: {e}") from None
    if not isinstance(config, dict) or config.get("version") != 1:
        raise ValueError(
            f'--log-config-file {path!r} must hold a JSON object with "version": 1 '
            "(logging.config.dictConfig's schema)"
        )
    return config


def uvicorn_log_config(args: FrontendArgs) -> dict[str, Any]:
    """The logging configuration uvicorn applies when it starts: --log-config-file's, else
    uvicorn's own default."""
    path = getattr(args, "log_config_file", None)
    if path is not None:
        return load_log_config(path)
    from uvicorn.config import LOGGING_CONFIG

    return LOGGING_CONFIG


def _parse_lora_module(text: str):
    from vllm.entrypoints.openai.serving_models import parse_lora_module

    return parse_lora_module(text)


def _tool_parser_names() -> tuple[str, ...]:
    from vllm.entrypoints.openai.tool_parsers import tool_parser_names  # registers them

    return tool_parser_names()


def _reasoning_parser_names() -> tuple[str, ...]:
    from vllm.reasoning import reasoning_parser_names  # registers them

    return reasoning_parser_names()


def frontend_args() -> tuple[ConfigArg, ...]:
    """One ``ConfigArg`` per ``FrontendArgs`` field (flag ``--field-name``)."""
    hints = get_type_hints(FrontendArgs)
    out = []
    for f in fields(FrontendArgs):
        meta = f.metadata
        flag = meta["flag"] or "--" + f.name.replace("_", "-")
        dest = flag.removeprefix("--").replace("-", "_")
        args = (meta["help"], meta["choices"], meta["parse"], meta["aliases"])
        out.append(ConfigArg("frontend", f.name, dest, flag, hints[f.name], f.default, *args))
    return tuple(out)
