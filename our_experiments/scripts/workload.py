"""The agentic workload: Poisson job arrivals, multi-turn jobs, simulated tools.

A job is an agent working on one task. Turn ``i`` sends the whole history (system prompt,
task, every previous model answer and tool output) with ``job_id`` and
``is_last_step = (i == turns - 1)``; the model's real answer is appended, then the
simulated tool "runs" (the client sleeps for the turn's tool time) and its output, a
real listing / source file / grep / test log / diff cut from the shipped corpus, becomes
the next user message. Tool times follow the research fork's per-turn table (fast
50-300 ms tools and one 2-5 s pytest turn) or are replayed from a trace (JSONL).

Everything here but ``run_job`` is pure and seeded, so tests check the arrival process,
the context growth and the trace replay without a server.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm.benchmarks.utils import percentile
from vllm.entrypoints.utils import INSTANCE_HEADER

ROOT = Path(__file__).resolve().parents[2]  # the repository
CORPUS_PATH = ROOT / "our_experiments" / "corpus" / "tool_outputs.json"
CHARS_PER_TOKEN = 3.5  # SmolLM2's tokenizer on code and logs; sizes in traces are tokens

# The fork's per-turn tool table (its ab_benchmark.py): (kind, min s, max s) for the tool
# run after turn i. The last turn has no tool; turns past the table repeat its tail.
TOOL_TABLE: list[tuple[str, float, float]] = [
    ("listing", 0.05, 0.15),  # find / ls
    ("source", 0.05, 0.10),  # cat
    ("source", 0.05, 0.10),  # cat
    ("grep", 0.08, 0.20),  # grep
    ("test_log", 2.0, 5.0),  # pytest: the slow, long-tailed turn
    ("source", 0.05, 0.10),  # cat
    ("diff", 0.10, 0.30),  # patch / git diff
]
# Output size per kind, in characters (uniform range): what an agent's tool prints after
# the usual truncation (SWE-agent cuts long outputs; mini-swe-agent keeps ~10k chars).
SIZE_CHARS: dict[str, tuple[int, int]] = {
    "listing": (300, 1200),
    "source": (800, 2400),
    "grep": (200, 900),
    "test_log": (600, 2000),
    "diff": (300, 1200),
}
COMMANDS = {
    "listing": "find . -name '*.py' | head -100",
    "source": "cat {path}",
    "grep": "grep -rn '{word}' .",
    "test_log": "python -m pytest -x tests",
    "diff": "git diff",
    "build": "make -j2",
    "install": "pip install -e .",
    "test_suite": "python -m pytest tests/",
}
# The "slow" mix (issue 12): tools in which a Continuum pin is wasted memory, as agents run
# them on real repositories (a build, an editable install, a whole test suite): (kind,
# min s, max s, corpus kind of their output). One turn in ``SLOW_SHARE`` runs one.
SLOW_TOOLS: list[tuple[str, float, float, str]] = [
    ("build", 10.0, 60.0, "test_log"),
    ("install", 10.0, 40.0, "test_log"),
    ("test_suite", 15.0, 60.0, "test_log"),
]
SLOW_SHARE = 0.3
TOOL_MIXES = ("fork", "slow", "guided")
# The "slow" mix's agent calls its shell through OpenAI function calling (as most agent
# frameworks do), and each turn's command is the one whose time the simulation waits:
# the `bash` tool's schema allows exactly that command, so guided decoding writes it
# (SmolLM2-135M does not follow a written hint), and the policy parses the real call.
# The "guided" mix is the fork mix's tools called that way: for a random-weight model
# (the GPU study's), whose own text names no command, so that ContextServe judges the
# commands the simulation runs instead of calling every turn UNCERTAIN.
HINTED_MIXES = ("slow", "guided")
HINTS = {
    "listing": "find . -name '*.py' | head -50",
    "source": "cat src/cache.py",
    "grep": "grep -rn 'cache_size' .",
    "test_log": "python -m pytest -x -q tests/test_cache.py",
    "diff": "git diff",
    "build": "make -j2",
    "install": "pip install -e .",
    "test_suite": "python -m pytest tests/",
}

SYSTEM_PROMPT = """You are a software engineering agent working in a Linux shell.
Each reply is one short thought and exactly one command in a ```bash block. The user \
answers with the command's output. Do not ask questions.

Example 1:
Task: Find where the cache size is configured.
I will search the code for the setting.
```bash
grep -rn "cache_size" .
```

Example 2:
Output: src/cache.py:12: cache_size = 64
I will open that file.
```bash
cat src/cache.py
```

Example 3:
Output: 1 failed, 12 passed
I will rerun the failing test with details.
```bash
python -m pytest -x -q tests/test_cache.py
```"""

TASKS = [
    "The KV block pool leaks a block when a request is aborted during prefill. Find the "
    "leak and fix it.",
    "Requests with a stop string sometimes return the stop string itself. Find out why.",
    "Add a --max-wait-time flag to the server and make sure it reaches the scheduler.",
    "The metrics endpoint reports kv_cache_usage_perc above 1.0 after a reset. Fix it.",
    "Tests in tests/v1/core fail on Python 3.12 with a DeprecationWarning. Investigate.",
    "The detokenizer drops the last character of multi-byte UTF-8 output. Fix it.",
    "Pinned blocks are not released when the job's last step is aborted. Find the bug.",
    "Make the chat template configurable per request and add a test.",
    "The scheduler spins at 100% CPU when all blocks are pinned. Find the busy loop.",
    "Preempted requests lose their sampling seed. Reproduce and fix.",
    "Add type hints to the request queue module and run the linter.",
    "The prefix cache hit rate is zero for prompts shorter than one block. Explain why.",
    "Streaming responses end without [DONE] when the client sets n=2. Fix it.",
    "Speed up the block hasher: it recomputes hashes of full blocks every step.",
    "The tool-call parser misses commands inside ```sh fences. Add support and a test.",
    "Write a regression test for the double free of the null block.",
]


@dataclass
class TurnSpec:
    """One turn: the user message to send, then the tool that runs after the answer."""

    user_content: str  # the task (turn 0) or the previous tool's output
    max_tokens: int
    tool_kind: str | None = None  # None on the last turn
    tool_s: float = 0.0  # simulated tool time after this turn's answer
    command: str | None = None  # slow mix: the shell command the agent's call must carry


@dataclass
class JobSpec:
    job_id: str
    arrival_s: float  # offset from the start of the run
    turns: list[TurnSpec] = field(default_factory=list)


def load_corpus(path: Path = CORPUS_PATH) -> dict[str, list[str]]:
    corpus = json.loads(Path(path).read_text())
    missing = [k for k in SIZE_CHARS if not corpus.get(k)]
    if missing:
        raise ValueError(f"corpus {path} has no entries of kind(s) {missing}")
    return corpus


def poisson_arrivals(jps: float, duration_s: float, rng: random.Random) -> list[float]:
    """Arrival offsets of a Poisson process of rate ``jps`` over ``[0, duration_s)``."""
    if jps <= 0:
        raise ValueError(f"jps must be > 0, got {jps}")
    if duration_s <= 0:
        raise ValueError(f"duration must be > 0, got {duration_s}")
    out, t = [], rng.expovariate(jps)
    while t < duration_s:
        out.append(t)
        t += rng.expovariate(jps)
    return out


def tool_output(corpus: dict[str, list[str]], kind: str, chars: int, rng: random.Random) -> str:
    """A real output of ``kind`` about ``chars`` long: one entry, or several joined."""
    parts, size = [], 0
    while size < chars:
        entry = rng.choice(corpus[kind])
        parts.append(entry)
        size += len(entry) + 1
    text = "\n".join(parts)[:chars]
    return text[: text.rfind("\n")] if "\n" in text[chars // 2 :] else text


def _observation(kind: str, text: str) -> str:
    return f"Output of `{COMMANDS[kind].split(' ', 1)[0]}`:\n{text}"


def _pick_tool(i: int, mix: str, rng: random.Random) -> tuple[str, float, str]:
    """(kind, seconds, corpus kind) of the tool run after turn ``i``."""
    kind, lo, hi = TOOL_TABLE[min(i, len(TOOL_TABLE) - 1)]
    if mix == "slow" and rng.random() < SLOW_SHARE:
        kind, lo, hi, corpus_kind = rng.choice(SLOW_TOOLS)
        return kind, rng.uniform(lo, hi), corpus_kind
    return kind, rng.uniform(lo, hi), kind


def make_job(
    job_id: str,
    arrival_s: float,
    turns: int,
    max_tokens: int,
    corpus: dict[str, list[str]],
    rng: random.Random,
    mix: str = "fork",
) -> JobSpec:
    """A synthetic job: a task, then per-turn tools from ``TOOL_TABLE`` (mix "fork"), or
    from that table with ``SLOW_SHARE`` of them slow and each turn's command hinted to
    the agent (mix "slow"), or the fork mix's tools with the commands hinted (mix
    "guided")."""
    if turns < 1:
        raise ValueError(f"turns must be >= 1, got {turns}")
    if mix not in TOOL_MIXES:
        raise ValueError(f"mix must be one of {TOOL_MIXES}, got {mix!r}")
    job = JobSpec(job_id, arrival_s)
    content = "Task: " + rng.choice(TASKS)
    for i in range(turns):
        turn = TurnSpec(content, max_tokens)
        if i < turns - 1:
            kind, seconds, corpus_kind = _pick_tool(i, mix, rng)
            turn.tool_kind, turn.tool_s = kind, seconds
            if mix in HINTED_MIXES:
                turn.command = HINTS[kind]
                turn.user_content += f"\nNext, run: {turn.command}"
            chars = rng.randint(*SIZE_CHARS[corpus_kind])
            content = _observation(kind, tool_output(corpus, corpus_kind, chars, rng))
        job.turns.append(turn)
    return job


def synthetic_jobs(
    jps: float,
    duration_s: float,
    turns: int,
    max_tokens: int,
    corpus: dict[str, list[str]],
    seed: int,
    max_jobs: int,
    mix: str = "fork",
) -> list[JobSpec]:
    rng = random.Random(seed)
    arrivals = poisson_arrivals(jps, duration_s, rng)[:max_jobs]
    return [
        make_job(f"job_{i:04d}", t, turns, max_tokens, corpus, random.Random(seed * 7919 + i), mix)
        for i, t in enumerate(arrivals)
    ]


def load_trace(
    path: Path,
    jps: float,
    corpus: dict[str, list[str]],
    seed: int,
    max_tokens: int,
    max_jobs: int,
) -> list[JobSpec]:
    """Jobs from a JSONL trace, one line per turn.

    Fields: ``job_id`` (required), ``turn`` (order within the job; default: file order),
    ``tool_duration_s`` (the tool run after this turn; ignored on the last turn),
    ``tool_output_tokens`` (size of that tool's output), ``tool_kind`` (a corpus kind,
    default ``source``), ``prompt_tokens`` (size of the first turn's user message: a task
    sentence, then quoted source code up to that size), ``max_tokens``, ``arrival_s``
    (the job's arrival; default Poisson at ``jps``). Sizes are reproduced with corpus text
    at ~3.5 characters per token.
    """
    rows: dict[str, list[dict[str, Any]]] = {}
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None
        if not isinstance(row, dict) or "job_id" not in row:
            raise ValueError(f"{path}:{n}: each line needs a job_id")
        kind = row.get("tool_kind", "source")
        if kind not in SIZE_CHARS:
            raise ValueError(f"{path}:{n}: tool_kind {kind!r} is not one of {list(SIZE_CHARS)}")
        rows.setdefault(str(row["job_id"]), []).append(row)
    rng = random.Random(seed)
    jobs, t = [], 0.0
    for job_id, turns in list(rows.items())[:max_jobs]:
        turns.sort(key=lambda r: r.get("turn", 0))
        t += rng.expovariate(jps)
        job = JobSpec(job_id, float(turns[0].get("arrival_s", t)))
        first = turns[0].get("prompt_tokens")
        content = "Task: " + rng.choice(TASKS)
        if first and _chars(first) > len(content) + 2:  # the task plus code it quotes
            extra = tool_output(corpus, "source", _chars(first) - len(content) - 2, rng)
            content += "\n\n" + extra
        for i, row in enumerate(turns):
            turn = TurnSpec(content, int(row.get("max_tokens", max_tokens)))
            if i < len(turns) - 1:
                kind = row.get("tool_kind", "source")
                turn.tool_kind, turn.tool_s = kind, float(row.get("tool_duration_s", 0.0))
                size = _chars(int(row.get("tool_output_tokens", 300)))
                content = _observation(kind, tool_output(corpus, kind, size, rng))
            job.turns.append(turn)
        jobs.append(job)
    jobs.sort(key=lambda j: j.arrival_s)
    return jobs


def repo_relative(path: Path | str) -> str:
    """``path`` relative to the repository if it lies inside it, else as given.

    Result files are committed, so they must not record where the repository happened
    to be checked out on the machine that ran them.
    """
    resolved = Path(path).resolve()
    try:
        return str(resolved.relative_to(ROOT))
    except ValueError:
        return str(path)


def _chars(tokens: int) -> int:
    return max(1, math.ceil(tokens * CHARS_PER_TOKEN))


@dataclass
class TurnResult:
    latency_ms: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    replica: str | None = None  # the server that answered (its x-vllm-instance header)


@dataclass
class JobResult:
    job_id: str
    duration_s: float = 0.0
    turns: list[TurnResult] = field(default_factory=list)
    error: str | None = None


def shell_tool_call(command: str | None) -> dict[str, Any]:
    """Request fields that make the agent call its `bash` tool with exactly ``command``
    (a named tool_choice, whose arguments guided decoding holds to the schema)."""
    if command is None:
        return {}
    schema = {
        "type": "object",
        "properties": {"command": {"type": "string", "enum": [command]}},
        "required": ["command"],
        "additionalProperties": False,
    }
    tool = {"type": "function", "function": {"name": "bash", "parameters": schema}}
    return {"tools": [tool], "tool_choice": {"type": "function", "function": {"name": "bash"}}}


def answer_text(message) -> str:
    """The assistant's turn as history text: its content, or its tool calls as JSON."""
    calls = getattr(message, "tool_calls", None) or []
    if calls:
        return json.dumps(
            [{"name": c.function.name, "arguments": c.function.arguments} for c in calls]
        )
    return message.content or ""


IDENTITIES = ("job_id", "prompt_cache_key", "x-session-id", "program_id")


def identity_fields(identity: str, job_id: str, last: bool, step: int = 0) -> dict[str, Any]:
    """The request fields that name turn ``step`` of a job: our ``job_id`` in
    ``extra_body``, the OpenAI API's own ``prompt_cache_key`` (what an unmodified agent
    sends), the ``X-Session-ID`` header (what vllm-router's consistent_hash routes by; the
    replica names the job by it too, docs/router.md), or ``program_id``: the router's
    Program identity (``vllm_xargs.agentic_context``, read by its
    ``--enable-program-scheduling``; ``expected_resume`` false on the last turn) plus the
    same header, so every routing policy sees the same requests. The last turn is marked
    with ``is_last_step`` in every case."""
    if identity == "x-session-id":
        return {"extra_headers": {"X-Session-ID": job_id}, "extra_body": {"is_last_step": last}}
    if identity == "program_id":
        context = {
            "program_id": job_id,
            "session_id": job_id,  # also the Program's task: one lead agent per job
            "step_id": step,
            "expected_resume": not last,
        }
        return {
            "extra_headers": {"X-Session-ID": job_id},
            "extra_body": {"vllm_xargs": {"agentic_context": context}, "is_last_step": last},
        }
    if identity == "prompt_cache_key":
        return {"prompt_cache_key": job_id, "extra_body": {"is_last_step": last}}
    if identity == "job_id":
        return {"extra_body": {"job_id": job_id, "is_last_step": last}}
    raise ValueError(f"identity must be one of {IDENTITIES}, got {identity!r}")


async def chat_turn(client, **request: Any) -> tuple[Any, str | None]:
    """One chat completion and the server that answered it (``INSTANCE_HEADER``; None if
    the server does not say)."""
    raw = await client.chat.completions.with_raw_response.create(**request)
    return raw.parse(), raw.headers.get(INSTANCE_HEADER)


async def run_job(
    client, model: str, job: JobSpec, request_timeout_s: float, identity: str = "job_id"
) -> JobResult:
    """Play one job against an OpenAI-compatible ``client`` (``openai.AsyncOpenAI``),
    naming its job by ``identity`` (``identity_fields``); each turn records the replica
    that served it."""
    result = JobResult(job.job_id)
    messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM_PROMPT}]
    start = time.monotonic()
    try:
        for i, turn in enumerate(job.turns):
            messages.append({"role": "user", "content": turn.user_content})
            sent = time.monotonic()
            resp, replica = await asyncio.wait_for(
                chat_turn(
                    client,
                    model=model,
                    messages=list(messages),
                    max_tokens=turn.max_tokens,
                    temperature=0,
                    **identity_fields(identity, job.job_id, i == len(job.turns) - 1, i),
                    **shell_tool_call(turn.command),
                ),
                request_timeout_s,
            )
            usage = resp.usage
            details = getattr(usage, "prompt_tokens_details", None)
            result.turns.append(
                TurnResult(
                    (time.monotonic() - sent) * 1e3,
                    usage.prompt_tokens,
                    (getattr(details, "cached_tokens", 0) or 0) if details else 0,
                    usage.completion_tokens,
                    replica,
                )
            )
            messages.append({"role": "assistant", "content": answer_text(resp.choices[0].message)})
            if turn.tool_kind is not None:
                await asyncio.sleep(turn.tool_s)  # the tool runs
    except Exception as e:  # a failed job is reported, not fatal to the run
        result.error = f"{type(e).__name__}: {e}"[:300]
    result.duration_s = time.monotonic() - start
    return result


def turn_moves(replicas: list[str | None]) -> int:
    """How many of a job's turns a different replica served than its previous turn (a
    turn whose replica is unknown is compared with neither neighbour)."""
    pairs = zip(replicas, replicas[1:], strict=False)
    return sum(a is not None and b is not None and a != b for a, b in pairs)


def routing_summary(results: list[JobResult]) -> dict[str, Any]:
    """Where the turns ran, from each turn's replica (behind a router): turns per replica,
    the turns that moved to another replica than their job's previous turn, and the jobs
    with any such move. Empty when no turn knows its replica (one server that does not
    name itself)."""
    served: dict[str, int] = {}
    moves: dict[str, int] = {}
    for r in results:
        replicas = [t.replica for t in r.turns]
        for replica in replicas:
            if replica is not None:
                served[replica] = served.get(replica, 0) + 1
        moves[r.job_id] = turn_moves(replicas)
    if not served:
        return {}
    return {
        "turns_per_replica": dict(sorted(served.items())),
        "turn_moves": sum(moves.values()),
        "jobs_with_turn_moves": sum(n > 0 for n in moves.values()),
        "job_turn_moves": {job: n for job, n in sorted(moves.items()) if n},
    }


def summarize(
    policy: str, jps: float, results: list[JobResult], window_s: float | None = None
) -> dict[str, Any]:
    """The fork's result schema, plus failure and cache counts, and the overload view:
    jobs finished inside the run's window (``window_s``: arrivals plus drain), goodput,
    and job times over *all* jobs, an unfinished one counted until the window's end (so
    those figures are lower bounds)."""
    done = [r for r in results if r.error is None]
    durations = [round(r.duration_s, 3) for r in done]
    all_durations = [round(r.duration_s, 3) for r in results]
    per_turn: dict[str, list[TurnResult]] = {}
    for r in done:
        for i, t in enumerate(r.turns):
            per_turn.setdefault(str(i + 1), []).append(t)

    def avg(key: str) -> dict[str, float]:
        return {
            k: round(statistics.mean(getattr(t, key) for t in v), 1) for k, v in per_turn.items()
        }

    prompt = sum(t.prompt_tokens for r in done for t in r.turns)
    cached = sum(t.cached_tokens for r in done for t in r.turns)
    return {
        "policy": policy,
        "jps": jps,
        "num_jobs": len(results),
        "num_completed": len(done),
        "num_failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "avg_duration_s": round(statistics.mean(durations), 3) if durations else None,
        "p50_duration_s": round(percentile(durations, 50), 3) if durations else None,
        "p90_duration_s": round(percentile(durations, 90), 3) if durations else None,
        "p95_duration_s": round(percentile(durations, 95), 3) if durations else None,
        "per_turn_avg_latency_ms": avg("latency_ms"),
        "per_turn_avg_prompt_tokens": avg("prompt_tokens"),
        "per_turn_avg_cached_tokens": avg("cached_tokens"),
        "client_cached_token_ratio": round(cached / prompt, 4) if prompt else None,
        "job_durations": durations,
        "goodput_jobs_per_min": round(len(done) / window_s * 60, 3) if window_s else None,
        "avg_duration_all_s": round(statistics.mean(all_durations), 3) if results else None,
        "p95_duration_all_s": round(percentile(all_durations, 95), 3) if results else None,
        **routing_summary(results),
    }
